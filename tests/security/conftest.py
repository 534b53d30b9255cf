"""Hostile clients against real daemons: raw frames, no or wrong tokens, other uids, full
and damaged disks. Helpers shared by the security tests."""
from __future__ import annotations

import os
import socket
import time

import pytest

from kvstore import wire as w
from kvstore.keys import Namespace

from ..integration.daemon.conftest import NS, ROOT, Daemon, block_of, make_daemon  # noqa: F401

TOKENS = "admin-secret\nalice-secret alice\nbob-secret bob\n"
ALICE = Namespace("shared-model", num_layers=1, num_kv_heads=1, head_dim=64, tenant="alice")
BOB = Namespace("shared-model", num_layers=1, num_kv_heads=1, head_dim=64, tenant="bob")


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    return str(path)


def raw_conn(daemon, timeout: float = 5) -> socket.socket:
    return socket.create_connection(("127.0.0.1", daemon.port), timeout=timeout)


def hello_msg(ns: Namespace = NS, token: str = "", **kw) -> w.Hello:
    return w.Hello(token=token, model=ns.model, num_layers=ns.num_layers,
                   num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim, dtype=ns.dtype,
                   block_tokens=ns.block_tokens, revision=ns.revision, tenant=ns.tenant, **kw)


def call(s: socket.socket, msg: w.Message, payload=()) -> w.Frame:
    w.send_frame(s, msg, msg.OP, False, payload)
    return w.recv_frame(s, 1 << 30)


def closed(s: socket.socket) -> bool:
    """True once the daemon has closed this connection (EOF or reset)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def local_conn(daemon, ns: Namespace = NS, token: str = "") -> socket.socket:
    """A raw connection to the daemon's local socket, named by HELLO over TCP."""
    with raw_conn(daemon) as s:
        name = call(s, hello_msg(ns, token)).msg.local_socket
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    u.settimeout(5)
    u.connect("\0" + name)
    return u


def metric(daemon, name: str, token: str = "admin-secret") -> float:
    """The sum of a Prometheus metric's samples on the daemon's /metrics."""
    import urllib.request
    req = urllib.request.Request(daemon.http + "/metrics",
                                 headers={"Authorization": f"Bearer {token}"})
    text = urllib.request.urlopen(req, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def wait_for(predicate, timeout_s: float = 10.0, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def nobody_can_run_here() -> str | None:
    """Why a process of uid `nobody` cannot run this checkout's Python, or None."""
    if os.geteuid() != 0:
        return "needs root to start processes of another uid"
    import subprocess
    import sys
    probe = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                            sys.executable, "-c", "import kvstore"], cwd=ROOT,
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"uid nobody cannot import kvstore: {probe.stderr}"
