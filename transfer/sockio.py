"""Socket receives in C where they can be (transfer/_stream.c): the one place kvstore's
frames (kvstore.wire) and the tcp transfer backend ask whether a socket's payload loop runs
in C or in Python (`loop_fd`, `recv_loop`), and how a connection polls before it sleeps
(`Spin`)."""
from __future__ import annotations

import socket
import time

try:
    from transfer._stream import recv_into as recv_loop, spin_recv
except ImportError:  # built without a C compiler: the loops run in Python, nothing polls
    recv_loop = spin_recv = None
"""recv_loop(fd, buffer, chunk) -> int: fill `buffer` from a blocking stream socket in
calls of `chunk` bytes (MSG_WAITALL), the GIL released once; hands back early when one
call comes back short (see transfer/_stream.c). None without the extension."""


def loop_fd(sock: socket.socket) -> int:
    """The socket's descriptor when `recv_loop` can serve it: the extension is built and the
    socket blocks, with kernel timeouts if any (the daemon's, the blocking Client's and the
    tcp backend's sockets). -1 otherwise: a socket with a Python timeout is non-blocking
    underneath, and only Python's own loop keeps its timeout."""
    return sock.fileno() if recv_loop is not None and sock.gettimeout() is None else -1


GROW_START_S = 10e-6  # a window grown back from nothing starts here


class Spin:
    """Polling a socket before a blocking receive, bounded and adaptive, as a VM guest's
    halt-polling is: a thread that blocks at once pays the CPU's wake-up when the bytes
    come (tens of us on a VM whose idle vCPUs halt: a 256 KiB request/reply between two
    processes took 95 us at p50 blocking, 33 us with both polling first). The window
    doubles, up to `max_s`, after a wait that polling served or that ended soon after it
    gave up, and halves after a longer one, so an idle connection soon polls for nothing
    (at most `max_s` of CPU per receive in any case). Without transfer._stream, or with
    `max_s` 0, it never polls."""

    __slots__ = ("max_s", "window_s", "_gave_up")

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s if spin_recv is not None else 0.0
        self.window_s = self.max_s
        self._gave_up = 0.0

    def poll(self, sock: socket.socket, view) -> int | None:
        """Bytes received into `view` within the window (0: the peer closed), or None when
        none came: then the caller blocks in its receive and calls `blocked` after it."""
        if not self.max_s:
            return None
        k = spin_recv(sock.fileno(), view, int(self.window_s * 1e9))
        if k >= 0:
            self.window_s = min(self.max_s, max(2 * self.window_s, GROW_START_S))
            return k
        self._gave_up = time.perf_counter()
        return None

    def blocked(self) -> None:
        """The blocking receive after a poll that gave up has returned."""
        if self.max_s:
            waited = time.perf_counter() - self._gave_up
            self.window_s = (min(self.max_s, max(2 * self.window_s, GROW_START_S))
                             if waited < self.max_s else self.window_s / 2)
