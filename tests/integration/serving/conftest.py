"""A real `kvtier cluster` (store node + 1 prefill + 2 decode workers + front end) on free
loopback ports, shared by the module and always stopped (its whole process group)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvtier-cluster-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "cluster", "--port", str(self.port), *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 420.0) -> "Cluster":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier cluster exited {self.proc.returncode}:\n{self.output()}")
            try:
                self.get_json("/healthz")
                return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"kvtier cluster did not come up:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.load(r)

    def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def stop(self) -> int | None:
        """Ctrl-C, then make sure nothing of the group is left."""
        rc = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                rc = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()
        return rc if rc is not None else self.proc.returncode


@pytest.fixture(scope="module")
def cluster():
    c = Cluster("--prefill", "1", "--decode", "2", "--num-blocks", "256")
    try:
        yield c.wait_ready()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference():
    """Our engine on SmolLM2 in this process, no store: the greedy oracle."""
    from engine_adapter import EngineConfig, LLMEngine, load_smollm2
    model, tokenizer = load_smollm2()
    engine = LLMEngine(model, EngineConfig(num_blocks=256), tokenizer=tokenizer)
    yield engine
    engine.close()
