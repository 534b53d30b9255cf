"""`DaemonProcess`: a `kvtier serve` child process, for launchers, benchmarks and tests.

It starts the daemon with `--port 0 --http-port 0` (the kernel picks free ports, no race
with other programs) and reads the bound addresses from the daemon's start-up line; a
restart reuses them, so clients following the same URL find it again. Its output is kept
(`output()`) so callers can check what it logged, and copied line by line to `echo` when
given (a launcher's log file or its stdout). Stop is SIGTERM (graceful: in-flight ops
finish, memory tiers flush to SSD), then SIGKILL if it does not end in time.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Callable, Sequence, TextIO

from kvstore.lifetime import child_env, teardown
from kvstore.wire import netloc

def freeze(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads is stopped. kill() returns
    before they are: the stop waits for one thread to take the signal, and a thread busy
    in user space (a connection polling for its next request) runs on meanwhile, long
    enough on a loaded host to serve a request sent after kill() returned."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_stopped(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} was sent SIGSTOP but is not stopped "
                               f"after {timeout_s} s")
        time.sleep(0.005)


def _all_stopped(pid: int) -> bool:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        if state not in "Tt":
            return False
    return True


_START = re.compile(r"data plane kvtier://\[?([^\s\]]+?)\]?:(\d+)\s+control http://\S+:(\d+)")


class DaemonProcess:
    def __init__(self, data_dir: str, *extra: str, dram_size: str = "256KiB",
                 ssd_size: str = "16MiB", log_level: str = "warning",
                 env: dict | None = None, cwd: str | None = None,
                 preexec_fn: Callable[[], None] | None = None,
                 wrap: Sequence[str] = (), echo: TextIO | None = None) -> None:
        """`extra`: more `kvtier serve` flags. `wrap`: a command prefix (e.g. `unshare -m`
        plus a shell that mounts a small tmpfs first). `echo`: where to copy its output."""
        self.data_dir, self.extra, self.echo = data_dir, extra, echo
        self.sizes = ("--dram-size", dram_size, "--ssd-size", ssd_size)
        self.log_level, self.env, self.cwd = log_level, env, cwd
        self.preexec_fn, self.wrap = preexec_fn, tuple(wrap)
        self.host, self.port, self.http_port = "127.0.0.1", 0, 0
        self.python = sys.executable  # the interpreter that runs `kvtier serve`
        self.proc: subprocess.Popen | None = None
        self._lines: list[str] = []
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"kvtier://{netloc(self.host, self.port)}"

    @property
    def http(self) -> str:
        return f"http://{netloc(self.host, self.http_port)}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        return [*self.wrap, self.python, "-m", "kvstore.daemon",
                "--port", str(self.port), "--http-port", str(self.http_port),
                "--data-dir", self.data_dir, *self.sizes, "--log-level", self.log_level,
                *self.extra]

    def start(self, timeout_s: float = 60.0) -> "DaemonProcess":
        """Start the daemon and wait until it answers. Without an `env` of the caller's, it
        ends with this process however that ends (`lifetime.child_env`): a benchmark or a
        test run killed outright had left its daemons running, arenas and all."""
        self._lines = []
        env = self.env if self.env is not None else {**os.environ, **child_env()}
        self.proc = subprocess.Popen(self.command(), cwd=self.cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, preexec_fn=self.preexec_fn)
        found = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(found,), daemon=True)
        self._reader.start()
        if not found.wait(timeout_s):
            self.kill()
            raise RuntimeError(f"kvtier serve did not start within {timeout_s}s:\n"
                               f"{self.output()}")
        if self.proc.poll() is not None and not self.port:
            raise RuntimeError(f"kvtier serve exited {self.proc.returncode}:\n{self.output()}")
        self._wait_healthy(timeout_s)
        return self

    def _read(self, found: threading.Event) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)
            if self.echo is not None:
                self.echo.write(line)
                self.echo.flush()
            m = _START.search(line)
            if m and not found.is_set():
                self.host, self.port, self.http_port = m.group(1), int(m.group(2)), int(m.group(3))
                found.set()
        found.set()  # exited: start() looks at the return code

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited {self.proc.returncode}:\n"
                                   f"{self.output()}")
            try:
                self.get_json("/healthz")
                return
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"kvtier serve did not become healthy:\n{self.output()}")

    def output(self) -> str:
        """Everything the daemon printed or logged so far."""
        return "".join(self._lines)

    def get_json(self, path: str, token: str = "") -> dict:
        req = urllib.request.Request(self.http + path,
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait; the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._join_reader()
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._join_reader()

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(5)

    def close(self) -> None:
        """Stop gracefully, and kill if that fails: every owner's teardown (a SIGTERM to
        a kvtier command meanwhile waits for it: `lifetime.teardown`)."""
        with teardown():
            try:
                self.stop()
            finally:
                self.kill()

    def __enter__(self) -> "DaemonProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

