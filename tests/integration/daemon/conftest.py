"""Real `kvtier serve` processes on free loopback ports, always stopped at teardown."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from kvstore.keys import Namespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NS = Namespace("test-model", num_layers=1, num_kv_heads=1, head_dim=64)  # 4 KiB blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_of(h: bytes, nbytes: int) -> np.ndarray:
    """Deterministic content of a block, so any process can check it byte for byte."""
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, nbytes, np.uint8)


class Daemon:
    python = sys.executable   # the interpreter that runs `kvtier serve`

    def __init__(self, data_dir: str, *extra: str) -> None:
        self.data_dir, self.extra = data_dir, extra
        self.port, self.http_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"kvtier://127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout_s: float = 30.0) -> "Daemon":
        cmd = [self.python, "-m", "kvstore.cli", "serve", "--port", str(self.port),
               "--http-port", str(self.http_port), "--data-dir", self.data_dir,
               "--dram-size", "256KiB", "--ssd-size", "16MiB", "--log-level", "warning",
               *self.extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited {self.proc.returncode}: "
                                   f"{self.proc.stdout.read()}")
            try:
                self.get_json("/healthz")
                return self
            except OSError:
                time.sleep(0.1)
        self.kill()
        raise RuntimeError("kvtier serve did not become healthy")

    def get_json(self, path: str, token: str = "") -> dict:
        req = urllib.request.Request(self.http + path,
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def close(self) -> None:
        """Stop gracefully, and kill if that fails: every fixture's teardown."""
        try:
            self.stop()
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def make_daemon(tmp_path):
    started: list[Daemon] = []

    def make(*extra: str, data_dir: str | None = None) -> Daemon:
        d = Daemon(data_dir or str(tmp_path / "data"), *extra)
        started.append(d)
        return d.start()

    yield make
    for d in started:
        d.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("daemon") / "data"), "--reservation-timeout", "1")
    d.start()
    yield d
    d.close()
