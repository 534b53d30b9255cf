"""Ports the kernel picks, and how a child process tells its parent which one it got.

    parent                                   child (a worker)
    spawn(..., --port 0 --port-file F)  ->   sock = bind(host, 0)
    wait_port_file(F, proc)             <-   write_port_file(F, port)   (before the slow start)
                                             ... load the model, calibrate ...
    connect: refused until                   web.run_app(app, sock=sock)   (listens)

Binding to port 0 leaves no window in which another program takes a port found free and
then closed (the race of "find a free port, pass it on"). The socket is bound, not
listening, until the server runs, so an early connection is refused as before, not queued.
F is written whole (a temporary file renamed over it): a reader sees the port or nothing.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; port 0: one the kernel picks."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's own sites
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


def wait_port_file(path: str, proc: subprocess.Popen, name: str, timeout_s: float = 300.0) -> int:
    """The port child `name` wrote to `path`; raises RuntimeError if it exits or times out
    first (start-up imports torch: tens of seconds on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError), open(path) as f:
            return int(f.read())
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before binding its "
                               "port; see its output above")
        time.sleep(0.05)
    raise RuntimeError(f"{name} did not report its port in {timeout_s:.0f} s")
