"""Socket receives looped in C where they can be (`recv_into` of transfer/_stream.c): the
one place kvstore's frames (kvstore.wire) and the tcp transfer backend ask whether a
socket's payload loop runs in C or in Python."""
from __future__ import annotations

import socket

try:
    from transfer._stream import recv_into as recv_loop
except ImportError:  # built without a C compiler: the loops run in Python
    recv_loop = None
"""recv_loop(fd, buffer, chunk) -> int: fill `buffer` from a blocking stream socket in
calls of `chunk` bytes (MSG_WAITALL), the GIL released once; hands back early when one
call comes back short (see transfer/_stream.c). None without the extension."""


def loop_fd(sock: socket.socket) -> int:
    """The socket's descriptor when `recv_loop` can serve it: the extension is built and the
    socket blocks, with kernel timeouts if any (the daemon's, the blocking Client's and the
    tcp backend's sockets). -1 otherwise: a socket with a Python timeout is non-blocking
    underneath, and only Python's own loop keeps its timeout."""
    return sock.fileno() if recv_loop is not None and sock.gettimeout() is None else -1
