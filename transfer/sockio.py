"""Socket receives in C where they can be (transfer/_stream.c): the one place kvstore's
frames (kvstore.wire) and the tcp transfer backend ask whether a socket's payload loop runs
in C or in Python (`loop_fd`, `recv_loop`), and how a connection polls before it sleeps
(`Spin`)."""
from __future__ import annotations

import os
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


def _open_loadavg() -> int:
    try:
        return os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # not Linux, or no /proc: never counted as oversubscribed
        return -1


_LOADAVG = _open_loadavg()
_CPUS = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1 << 30,
            os.cpu_count() or 1)


def oversubscribed() -> bool:
    """Whether the host has more threads runnable right now than this process has CPUs
    (the running count of /proc/loadavg, the caller included; ~0.5 us): a poller would
    then hold a CPU that another thread, maybe the very peer it waits for, needs. On a
    2-vCPU VM beside 2 busy processes a 256 KiB TCP get took 221-254 us on average with
    both ends polling, 74-96 with neither. False where it cannot be read."""
    if _LOADAVG < 0:
        return False
    try:
        return int(os.pread(_LOADAVG, 64, 0).split()[3].split(b"/")[0]) > _CPUS
    except (OSError, ValueError, IndexError):
        return False


GROW_START_S = 10e-6  # a window grown back from nothing starts here
REST_S = 0.05  # after a poll that was descheduled, no polling for this long


class Spin:
    """Polling a socket before a blocking receive, bounded and adaptive, as a VM guest's
    halt-polling is: a thread that blocks at once pays the CPU's wake-up when the bytes
    come (tens of us on a VM whose idle vCPUs halt: a 256 KiB request/reply between two
    processes took 95 us at p50 blocking, 33 us with both polling first). The window
    doubles, up to `max_s`, after a wait that polling served or that ended soon after it
    gave up, and halves after a longer one, so an idle connection soon polls for nothing
    (at most `max_s` of CPU per receive in any case). A poll during which the thread was
    descheduled says the CPUs are oversubscribed: then a poller holds a CPU its peer may
    need, and nothing polls for REST_S (then one poll tries again); nor does it poll while
    more threads are runnable than there are CPUs (`oversubscribed`). Without
    transfer._stream, or with `max_s` 0, it never polls."""

    __slots__ = ("max_s", "window_s", "_gave_up", "_rest_until")

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s if spin_recv is not None else 0.0
        self.window_s = self.max_s
        self._gave_up = 0.0  # when the last poll gave up (0: it did not poll, or was cut)
        self._rest_until = 0.0

    def poll(self, sock: socket.socket, view) -> int | None:
        """Bytes received into `view` within the window (0: the peer closed), or None when
        none came: then the caller blocks in its receive and calls `blocked` after it."""
        self._gave_up = 0.0
        if (not self.max_s or (self._rest_until and time.perf_counter() < self._rest_until)
                or oversubscribed()):
            return None
        k = spin_recv(sock.fileno(), view, int(self.window_s * 1e9))
        if k >= 0:
            self.window_s = min(self.max_s, max(2 * self.window_s, GROW_START_S))
            return k
        now = time.perf_counter()
        if k == -2:  # descheduled while polling: the CPUs have more work than they can run
            self._rest_until = now + REST_S
            return None
        self._rest_until = 0.0
        self._gave_up = now
        return None

    def blocked(self) -> None:
        """The blocking receive after a poll that gave up has returned."""
        if self._gave_up:
            waited = time.perf_counter() - self._gave_up
            self.window_s = (min(self.max_s, max(2 * self.window_s, GROW_START_S))
                             if waited < self.max_s else self.window_s / 2)
