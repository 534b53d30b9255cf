"""Socket receives in C where they can be (transfer/_stream.c): the one place kvstore's
frames (kvstore.wire) and the tcp transfer backend ask whether a socket's payload loop runs
in C or in Python (`loop_fd`, `recv_loop`), how a connection polls before it sleeps
(`Spin`), and where in a frame a payload starts (`payload_pad`)."""
from __future__ import annotations

import errno
import os
import socket
import threading
import time

try:
    from transfer._stream import recv_into as recv_loop, spin_recv
except ImportError:  # built without a C compiler: the loops run in Python, nothing polls
    recv_loop = spin_recv = None
"""recv_loop(fd, buffer, chunk) -> int: fill `buffer` from a blocking stream socket in
calls of `chunk` bytes (MSG_WAITALL), the GIL released once; hands back early when one
call comes back short (see transfer/_stream.c). None without the extension."""


# A frame's payload (kvstore's, the tcp backend's) starts at a multiple of this many bytes
# from the frame's first byte. On loopback the receiving kernel copies a payload out of the
# pages the sending kernel copied it into, filled from the frame's first byte on, and that
# copy ran at well under half speed where the payload's place in those pages and its
# destination differ modulo 64: measured here, a 64 MiB stream received into memory 16
# bytes past a 64-byte boundary, 1.8 GB/s against 4.2-4.8 into an aligned one (three runs
# alike). Arena slots and tensors are aligned; a header of any other length puts every
# payload after it out of step with them, as we read it (GET replies' 42 bytes before 16
# blocks), though a sweep of header lengths into aligned memory varied from run to run.
# Paired in one process the gain for the daemon's gets was within noise (16 x 4 MiB
# 0.90-1.00 -> 0.92-1.04 of a raw socket), and gets into memory 16 bytes off measured as
# fast as aligned ones: with 1 MiB socket buffers the bytes are still in cache when copied.
PAYLOAD_ALIGN = 64
PAD = bytes(PAYLOAD_ALIGN)


def payload_pad(head_bytes: int) -> int:
    """The zero bytes a frame puts after its first `head_bytes` (fixed head and header) so
    that its payload starts at a multiple of PAYLOAD_ALIGN."""
    return -head_bytes % PAYLOAD_ALIGN


def pad_is_zero(buf: bytes | bytearray, start: int) -> bool:
    """Whether `buf` from `start` on (a header's pad) is all zero bytes: a sender that did
    not pad has its payload's first bytes there."""
    return buf.count(0, start) == len(buf) - start


def loop_fd(sock: socket.socket) -> int:
    """The socket's descriptor when `recv_loop` can serve it: the extension is built and the
    socket blocks, with kernel timeouts if any (the daemon's, the blocking Client's and the
    tcp backend's sockets). -1 otherwise: a socket with a Python timeout is non-blocking
    underneath, and only Python's own loop keeps its timeout."""
    return sock.fileno() if recv_loop is not None and sock.gettimeout() is None else -1


WAITED_NS = 10_000  # a thread that waited this long for a CPU since its last look


def _fd_room() -> int:
    """Descriptors below this number may hold a thread's schedstat: half the process's
    limit, so that one per connection thread never takes what its sockets need."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1 << 20
    return (1 << 20) if soft == resource.RLIM_INFINITY else soft // 2


_FD_ROOM = _fd_room()


def _run_delay(fd: int) -> int:
    """The run_delay field (the second) of an open schedstat file."""
    return int(os.pread(fd, 96, 0).split()[1])


class _SchedStat:
    """The calling thread's /proc/thread-self/schedstat, kept open (a pread: 0.4-4 us by
    host and cache): its run_delay, the nanoseconds it has spent runnable but waiting for
    a CPU."""

    __slots__ = ("fd", "last")

    def __init__(self) -> None:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if fd >= _FD_ROOM:  # the process is using many: its sockets come first
                raise OSError(errno.EMFILE, "no room for a schedstat descriptor")
            self.last = _run_delay(fd)
        except BaseException:
            os.close(fd)  # (never kept: `__del__` must not close the number again, which
            raise  # may be another file's by then)
        self.fd = fd

    def run_delay(self) -> int:
        return _run_delay(self.fd)

    def __del__(self) -> None:  # the thread ended (threading.local lets go of it)
        fd = getattr(self, "fd", -1)  # (unset when __init__ failed: nothing to close)
        if fd >= 0:
            try:
                os.close(fd)
            except (OSError, TypeError):  # (at interpreter exit)
                pass


_mine = threading.local()


def _forget_parents_threads() -> None:
    """A forked child's threads are not the parent's: each looks at its own afresh."""
    global _mine
    _mine = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_threads)


def waited_for_cpu() -> bool:
    """Whether the calling thread waited WAITED_NS or more for a CPU since its last look
    (its run_delay, 0.4-4 us a look): the CPUs have more work than they can run, and a
    poller would hold one that another thread, maybe the very peer it waits for, needs.
    Measured on a 2-vCPU VM, per 256 KiB TCP op of a client thread that does not poll:
    0.1-0.3 us quiet, 33-99 us beside 2 busy processes (where both ends polling took a
    get from 74-96 us on average to 221-254). False where schedstat cannot be read, and in
    a thread that found the process's descriptors past half its limit (`_FD_ROOM`)."""
    stat = getattr(_mine, "stat", None)
    if stat is _UNKNOWN:
        return False
    try:
        if stat is None:
            _mine.stat = _SchedStat()  # the first look: nothing to compare yet
            return False
        now = stat.run_delay()
    except (OSError, ValueError, IndexError):  # no schedstats here: never counted
        _mine.stat = _UNKNOWN
        return False
    waited, stat.last = now - stat.last, now
    return waited >= WAITED_NS


_UNKNOWN = object()  # the look of a thread whose schedstat cannot be read


def _open_loadavg() -> int:
    try:
        return os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # not Linux, or no /proc: never counted as oversubscribed
        return -1


_LOADAVG = _open_loadavg()
_CPUS = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1 << 30,
            os.cpu_count() or 1)


def oversubscribed() -> bool:
    """Whether the host has more threads running or runnable right now than this process
    has CPUs (the running count of /proc/loadavg, the caller included; 0.5-4.4 us a look).
    What a poller's own run_delay cannot show: a thread that polls does not wait for a
    CPU, the peer it keeps from one does (beside 2 busy processes, a client polling for
    a 256 KiB put's reply took it from 130 to 223 us at p50). False where it cannot be
    read."""
    if _LOADAVG < 0:
        return False
    try:
        return int(os.pread(_LOADAVG, 64, 0).split()[3].split(b"/")[0]) > _CPUS
    except (OSError, ValueError, IndexError):
        return False


GROW_START_S = 10e-6  # a window grown back from nothing starts here
LOOK_S = 1e-3  # how long a look at the CPUs (waited_for_cpu, oversubscribed) stands: a
# thread's run_delay grows by 0.1-0.3 us a request on a quiet host, 33-99 us beside 2 busy
# processes, so WAITED_NS over a millisecond still tells the two apart


class Spin:
    """Polling a socket before a blocking receive, bounded and adaptive, as a VM guest's
    halt-polling is: a thread that blocks at once pays the CPU's wake-up when the bytes
    come (tens of us on a VM whose idle vCPUs halt: a 256 KiB request/reply between two
    processes took 95 us at p50 blocking, 33 us with both polling first). The window
    doubles, up to `max_s`, after a wait that polling served or that ended soon after it
    gave up, and halves after a longer one, so an idle connection soon polls for nothing
    (at most `max_s` of CPU per receive in any case). Nothing polls while the CPUs have
    more work than they can run, where a poller would hold one its peer may need: not
    while more threads are runnable than there are CPUs (`oversubscribed`), nor in a
    thread that waited for a CPU since its last look (`waited_for_cpu`); a poll during
    which the thread was descheduled ends at once (that wait shows at its next look).
    Without transfer._stream, or with `max_s` 0, it never polls.

    Those two looks (a /proc read each, 2-4 us on a 2-vCPU VM, twice that run cold after
    a megabyte's copy: ~10-15 us of each request/reply between a client and the daemon)
    stand for LOOK_S; a poll cut short by the thread's descheduling counts as a look that
    found the CPUs short."""

    __slots__ = ("max_s", "window_s", "_gave_up", "_looked_at", "_short")

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s if spin_recv is not None else 0.0
        self.window_s = self.max_s
        self._gave_up = 0.0  # when the last poll gave up (0: it did not poll, or was cut)
        self._looked_at = -LOOK_S  # when the CPUs were last looked at (perf_counter)
        self._short = False  # what that look found: more work than CPUs

    def poll(self, sock: socket.socket, view) -> int | None:
        """Bytes received into `view` within the window (0: the peer closed), or None when
        none came: then the caller blocks in its receive and calls `blocked` after it."""
        self._gave_up = 0.0
        if not self.max_s:
            return None
        now = time.perf_counter()
        if now - self._looked_at >= LOOK_S:
            self._looked_at = now
            self._short = waited_for_cpu() or oversubscribed()
        if self._short:
            return None
        k = spin_recv(sock.fileno(), view, int(self.window_s * 1e9))
        if k >= 0:
            self.window_s = min(self.max_s, max(2 * self.window_s, GROW_START_S))
            return k
        if k == -1:  # (-2: descheduled while polling; the wait that follows says nothing
            self._gave_up = time.perf_counter()  # of the window)
        else:
            self._short, self._looked_at = True, time.perf_counter()
        return None

    def blocked(self) -> None:
        """The blocking receive after a poll that gave up has returned."""
        if self._gave_up:
            waited = time.perf_counter() - self._gave_up
            self.window_s = (min(self.max_s, max(2 * self.window_s, GROW_START_S))
                             if waited < self.max_s else self.window_s / 2)
