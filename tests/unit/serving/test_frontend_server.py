"""The front end's own server (`frontend.serve`) caps its connections and gives each one's
first request head a deadline: under aiohttp's `run_app`, connections that sent half a head
(or nothing) held their descriptors for good. A real process serving a real socket, stopped
by SIGTERM; raw sockets as the clients."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SERVER = textwrap.dedent("""
    import socket, sys
    from aiohttp import web
    from engine_adapter.serving import frontend

    app = web.Application()
    app[frontend.CFG_KEY] = frontend.FrontendConfig(max_connections=4, header_deadline_s=1.0)
    app.router.add_get("/", lambda request: web.Response(text="ok"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    frontend.serve(app, sock, ready=lambda: print(port, flush=True))
    print("stopped", flush=True)
""")


@pytest.fixture
def server():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return s.recv(4096)


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, TimeoutError, socket.timeout):
        return True


def test_half_sent_heads_are_closed_at_the_deadline_and_never_lock_the_front_end_out(server):
    proc, port = server
    assert _get(port).startswith(b"HTTP/1.1 200")
    loris = []
    for _ in range(12):  # three times the cap, each with a head that never ends
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        loris.append(s)
    # at the cap a newcomer takes an idle one's place: a real request is still served
    assert _get(port).startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    assert all(_closed(s) for s in loris)  # pushed out or past the 1 s deadline
    assert time.monotonic() - t0 < 5
    for s in loris:
        s.close()
    silent = socket.create_connection(("127.0.0.1", port), timeout=5)  # sends nothing
    assert _closed(silent)
    silent.close()
    assert _get(port).startswith(b"HTTP/1.1 200")
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.read().strip() == "stopped"
    assert proc.wait(timeout=30) == 0
