"""A real `kvtier cluster` process on loopback ports the kernel picks (its banner names the
API's), stopped with its whole process group; helpers to read its SSE streams."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
API = re.compile(r"the API opens at (http://\S+) ")


class Cluster:
    def __init__(self, *args: str) -> None:
        self.url = ""  # from its banner, in wait_ready
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvtier-cluster-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "cluster", "--port", "0", *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 420.0) -> "Cluster":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier cluster exited {self.proc.returncode}:\n{self.output()}")
            banner = API.search(self._text())
            if banner:
                self.url = banner.group(1)
                with contextlib.suppress(OSError):
                    self.get_json("/healthz")
                    return self
            time.sleep(0.5)
        raise RuntimeError(f"kvtier cluster did not come up:\n{self.output()}")

    def _text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def output(self) -> str:
        return self._text()[-4000:]

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
        """Ctrl-C, then make sure nothing of the group is left; `left_behind`: whether any
        of it outlived kvtier cluster (a child it lost track of)."""
        rc = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                rc = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, 0)
            self.left_behind = True
        except ProcessLookupError:
            self.left_behind = False
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()
        return rc if rc is not None else self.proc.returncode


SYSTEM = ("You are kvtier's test assistant. " + "Answer briefly and precisely, and never "
          "invent facts you are not sure about. " * 12)


def sse_events(url: str, path: str, body: dict):
    """(response headers, iterator of decoded `data:` payloads) of a streamed request."""
    req = urllib.request.Request(url + path, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=300)

    def events():
        with resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    yield line[6:]
    return resp.headers, events()
