"""The receive loop in C (transfer._stream.recv_into) that kvstore.wire and the tcp
backend use on blocking sockets: it fills the buffer whatever pieces the bytes come in, and
comes back short (for its caller to check a deadline, or meet the error) whenever one call
does: the peer closed, the socket's receive timeout ran out, a signal arrived."""
from __future__ import annotations

import select
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

stream = pytest.importorskip("transfer._stream", reason="transfer._stream is missing: "
                             "reinstall kvtier with a C compiler (pip install -e .)")

CHUNK = 64 << 10


def _pair(timeout_s: float = 5.0) -> tuple[socket.socket, socket.socket]:
    """A socket pair whose receiving end blocks with a kernel receive timeout, as the
    daemon's and the client's do (wire.kernel_timeouts)."""
    a, b = socket.socketpair()
    b.settimeout(None)
    tv = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6))
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    return a, b


def _send_in_pieces(sock: socket.socket, data: bytes, piece: int, pause_s: float = 0.0):
    def run():
        for lo in range(0, len(data), piece):
            sock.sendall(data[lo:lo + piece])
            if pause_s:
                time.sleep(pause_s)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_fills_the_buffer_from_pieces_that_straddle_its_chunks():
    n = 5 * CHUNK + 777
    data = bytes(np.random.default_rng(3).integers(0, 256, n, np.uint8))
    a, b = _pair()
    with a, b:
        t = _send_in_pieces(a, data, 40_001)
        out = bytearray(n + 10)
        assert stream.recv_into(b.fileno(), memoryview(out)[:n], CHUNK) == n
        t.join()
        assert bytes(out[:n]) == data and out[n:] == bytes(10)


def test_comes_back_short_when_the_peer_closes_then_gives_zero():
    a, b = _pair()
    with b:
        a.sendall(b"z" * (CHUNK + 5))
        a.close()
        out = bytearray(3 * CHUNK)
        assert stream.recv_into(b.fileno(), out, CHUNK) == CHUNK + 5
        assert out[:CHUNK + 5] == b"z" * (CHUNK + 5) and not any(out[CHUNK + 5:])
        assert stream.recv_into(b.fileno(), memoryview(out)[CHUNK + 5:], CHUNK) == 0


def test_a_receive_timeout_with_nothing_raises_and_with_some_bytes_returns_them():
    a, b = _pair(timeout_s=0.1)
    with a, b:
        with pytest.raises(BlockingIOError):
            stream.recv_into(b.fileno(), bytearray(100), CHUNK)
        a.sendall(b"q" * 30)
        out = bytearray(100)
        assert stream.recv_into(b.fileno(), out, CHUNK) == 30  # back to its caller
        assert out[:30] == b"q" * 30


def test_a_peer_trickling_bytes_hands_control_back_at_each_timeout(trickling_peer):
    """A peer that never goes quiet for a whole receive timeout must not keep the loop for
    as long as it likes: every timeout comes back to the caller (who checks a deadline)."""
    a, b = _pair(timeout_s=0.2)
    with a, b:
        a.send(b"t")  # (one byte in before the first timeout, however late the thread)
        with trickling_peer(a) as gave_up:
            got = stream.recv_into(b.fileno(), bytearray(1 << 20), CHUNK)
            assert not gave_up.is_set(), "it waited for the peer to give up"
        assert 0 < got < 1 << 20


def test_bad_arguments_are_refused():
    a, b = _pair()
    with a, b:
        with pytest.raises(ValueError, match="positive"):
            stream.recv_into(b.fileno(), bytearray(10), 0)
        with pytest.raises(TypeError):  # read-only
            stream.recv_into(b.fileno(), b"x" * 10, CHUNK)
        with pytest.raises(OSError):  # not a socket
            stream.recv_into(-1, bytearray(10), CHUNK)


def _signal_main_thread_in(delay_s: float) -> threading.Timer:
    """SIGALRM to this (the main) thread `delay_s` from now, while it waits in the loop."""
    t = threading.Timer(delay_s, signal.pthread_kill,
                        (threading.main_thread().ident, signal.SIGALRM))
    t.start()
    return t


def test_a_signal_runs_its_handler_and_the_receive_goes_on_or_stops_if_it_raises():
    assert threading.current_thread() is threading.main_thread()
    seen = []
    old = signal.signal(signal.SIGALRM, lambda *_: seen.append(1))
    a, b = _pair()
    try:
        with a, b:
            timer = _signal_main_thread_in(0.1)
            sender = threading.Timer(0.4, a.sendall, (b"s" * 1024,))
            sender.start()
            out = bytearray(1024)
            got = stream.recv_into(b.fileno(), out, CHUNK)  # interrupted before any byte
            timer.join()
            sender.join()
            assert got == 1024 and out == b"s" * 1024 and seen == [1]

            def boom(*_):
                raise KeyboardInterrupt
            signal.signal(signal.SIGALRM, boom)
            timer = _signal_main_thread_in(0.1)
            with pytest.raises(KeyboardInterrupt):
                stream.recv_into(b.fileno(), bytearray(10), CHUNK)
            timer.join()
    finally:
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("loop", ["C", "Python"])
def test_the_tcp_backend_fills_big_and_small_views_with_either_loop(loop, monkeypatch):
    """The tcp transfer backend's receive (transfer.sockio picks the loop): views bigger
    than a chunk, straddling chunks, and small ones gathered, filled in order from bytes
    that come in odd pieces."""
    from transfer import sockio
    from transfer.backends import tcp_wire
    if loop == "Python":
        monkeypatch.setattr(sockio, "recv_loop", None)
    a, b = _pair()
    with a, b:
        assert (sockio.loop_fd(b) >= 0) == (loop == "C")
        sizes = [3 * CHUNK + 7, 10, 5, CHUNK, 1, 2 * CHUNK - 3]
        data = np.random.default_rng(1).integers(0, 256, sum(sizes), np.uint8).tobytes()
        views = [bytearray(n) for n in sizes]
        sender = _send_in_pieces(a, data, 50_003)
        tcp_wire.recv_views(b, views, tcp_wire.Progress(), 5.0, lambda: False)
        sender.join()
        assert b"".join(views) == data


def test_spin_recv_receives_what_arrives_while_it_polls():
    """transfer._stream.spin_recv: bytes that come while it polls are received (or, where
    it was descheduled meanwhile, -2 and the bytes left for the next read); none in its
    window gives -1; a closed peer 0."""
    a, b = _pair()
    with a, b:
        buf = bytearray(8)
        for _ in range(20):
            sender = threading.Timer(0.005, a.send, args=(b"abc",))
            sender.start()
            got = stream.spin_recv(b.fileno(), buf, 5 * 10**9)
            sender.join()
            if got != -2:
                break
            assert b.recv(8) == b"abc"  # descheduled while polling (a busy host): again
        else:  # (a host with no CPU free for the sender: it preempts the poller each time,
            # as a full suite's run met once; then the bytes are sent before the poll)
            a.send(b"abc")
            got = stream.spin_recv(b.fileno(), buf, 5 * 10**9)
        assert got == 3 and buf[:3] == b"abc"
        idle = [stream.spin_recv(b.fileno(), buf, 10**6) for _ in range(20)]
        assert -1 in idle and set(idle) <= {-1, -2}  # nothing came (-2: descheduled meanwhile)
        a.close()
        assert stream.spin_recv(b.fileno(), buf, 10**6) == 0


SPINNER = """
import socket, sys
from transfer import _stream
a, b = socket.socketpair()
print("polling", flush=True)
print(_stream.spin_recv(b.fileno(), bytearray(8), 30 * 10**9), flush=True)
"""


def test_spin_recv_says_when_its_thread_was_descheduled():
    """A poller stopped for a while (here by SIGSTOP; on a busy host by the scheduler)
    comes back at once with -2, not at the end of its window."""
    import os
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "polling"
        for _ in range(20):  # until a stop lands inside spin_recv (its window is 30 s)
            time.sleep(0.1)
            os.kill(p.pid, signal.SIGSTOP)
            time.sleep(0.05)
            os.kill(p.pid, signal.SIGCONT)
            if select.select([p.stdout], [], [], 1.0)[0]:
                break
        assert p.stdout.readline().strip() == "-2"
        assert p.wait(10) == 0
    finally:
        p.kill()
        p.wait()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_spin_window_adapts_and_stands_down_when_the_cpus_are_oversubscribed(monkeypatch):
    """transfer.sockio.Spin's policy, against scripted spin_recv results and a scripted
    clock: the window doubles after a served poll or a wait that ended soon after it
    gave up, halves after a long one; a poll cut short because the thread was descheduled
    teaches the window nothing and stands as a look that found the CPUs short; a thread
    that waited for a CPU does not poll; a look stands for LOOK_S; max_s 0 never polls."""
    from transfer import sockio
    clock, results, windows, waited = _Clock(), [], [], [False]

    def scripted(fd, view, window_ns):
        windows.append(window_ns)
        return results.pop(0)
    monkeypatch.setattr(sockio, "spin_recv", scripted)
    monkeypatch.setattr(sockio, "time", clock)
    monkeypatch.setattr(sockio, "waited_for_cpu", lambda: waited[0])
    monkeypatch.setattr(sockio, "oversubscribed", lambda: False)
    a, b = _pair()
    with a, b:
        buf = bytearray(8)
        spin = sockio.Spin(0.001)
        results[:] = [-1]
        assert spin.poll(b, buf) is None
        clock.now += 0.01  # the bytes came long after it gave up: poll less
        spin.blocked()
        assert spin.window_s == 0.0005
        results[:] = [-1]
        assert spin.poll(b, buf) is None
        clock.now += 0.0001  # came right after: worth polling longer
        spin.blocked()
        assert spin.window_s == 0.001
        results[:] = [3]
        assert spin.poll(b, buf) == 3 and spin.window_s == 0.001
        results[:] = [-2]  # descheduled while polling
        assert spin.poll(b, buf) is None
        clock.now += 0.01
        spin.blocked()  # a wait after a cut poll teaches the window nothing
        assert spin.window_s == 0.001
        waited[0] = True  # the thread waited for a CPU since its last look
        assert spin.poll(b, buf) is None and not results  # spin_recv not called
        spin.blocked()
        assert spin.window_s == 0.001
        waited[0] = False
        assert spin.poll(b, buf) is None and not results  # (the look stands for LOOK_S)
        clock.now += sockio.LOOK_S
        monkeypatch.setattr(sockio, "oversubscribed", lambda: True)  # more runnable than CPUs
        assert spin.poll(b, buf) is None and not results
        monkeypatch.setattr(sockio, "oversubscribed", lambda: False)
        clock.now += sockio.LOOK_S
        results[:] = [5]
        assert spin.poll(b, buf) == 5  # polls again
        # a look that found the CPUs free stands as long: no /proc read per poll
        looks = []
        monkeypatch.setattr(sockio, "waited_for_cpu", lambda: looks.append(1) or False)
        results[:] = [6, 7]
        assert spin.poll(b, buf) == 6 and spin.poll(b, buf) == 7 and not looks
        clock.now += sockio.LOOK_S
        results[:] = [8]
        assert spin.poll(b, buf) == 8 and looks == [1]
        assert windows == [10**6, 5 * 10**5] + [10**6] * 6
        assert sockio.Spin(0).poll(b, buf) is None and not results


def _scripted_schedstat(tmp_path, monkeypatch):
    """This thread's schedstat look, reading a file the test writes (run_delay second)."""
    import os
    from transfer import sockio
    path = tmp_path / "schedstat"
    path.write_text("5000 0 1\n")
    stat = sockio._SchedStat.__new__(sockio._SchedStat)
    stat.fd = os.open(path, os.O_RDONLY)
    stat.last = 0
    monkeypatch.setattr(sockio, "_mine", type("Mine", (), {"stat": stat})())
    return path


def test_waited_for_cpu_compares_run_delay_since_the_last_look(monkeypatch, tmp_path):
    from transfer import sockio
    path = _scripted_schedstat(tmp_path, monkeypatch)
    assert sockio.waited_for_cpu() is False
    path.write_text(f"9000 {sockio.WAITED_NS - 1} 2\n")  # less than WAITED_NS since
    assert sockio.waited_for_cpu() is False
    path.write_text(f"9000 {2 * sockio.WAITED_NS} 3\n")
    assert sockio.waited_for_cpu() is True
    assert sockio.waited_for_cpu() is False  # nothing more since that look
    path.write_text("garbage\n")  # unreadable: never counted, and not looked at again
    assert sockio.waited_for_cpu() is False and sockio._mine.stat is sockio._UNKNOWN
    path.write_text(f"9000 {10 * sockio.WAITED_NS} 3\n")
    assert sockio.waited_for_cpu() is False


def test_a_thread_keeps_no_schedstat_descriptor_past_half_the_limit(monkeypatch):
    """With the process's descriptors past half its limit, a new thread goes without the
    look (and without the descriptor) rather than take one its sockets may need."""
    import os
    from transfer import sockio
    monkeypatch.setattr(sockio, "_FD_ROOM", 0)
    seen = {}

    def look():
        seen["looks"] = [sockio.waited_for_cpu() for _ in range(3)]
        seen["stat"] = sockio._mine.stat
        mine = f"/task/{threading.get_native_id()}/schedstat"
        seen["kept"] = [fd for fd in os.listdir("/proc/self/fd")
                        if _link(f"/proc/self/fd/{fd}").endswith(mine)]
    t = threading.Thread(target=look)
    t.start()
    t.join()
    assert seen["looks"] == [False] * 3 and seen["stat"] is sockio._UNKNOWN
    assert seen["kept"] == []


def _link(path: str) -> str:
    import os
    try:
        return os.readlink(path)
    except OSError:
        return ""


def test_a_failed_look_closes_its_descriptor_once(monkeypatch):
    """Closed where the look failed, and never again when the half-made object goes: by
    then the number may be a socket another thread just accepted (a daemon out of
    descriptors lost connections to exactly that)."""
    import gc
    import os
    from transfer import sockio
    monkeypatch.setattr(sockio, "_FD_ROOM", 0)
    real_open, real_close, opened, closed = os.open, os.close, [], []

    def recording_open(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if str(path).endswith("thread-self/schedstat"):
            opened.append(fd)
        return fd

    def recording_close(fd):
        if fd in opened:
            closed.append(fd)
        real_close(fd)

    def look():
        monkeypatch.setattr(os, "open", recording_open)
        monkeypatch.setattr(os, "close", recording_close)
        try:
            assert sockio.waited_for_cpu() is False
            gc.collect()
        finally:
            monkeypatch.setattr(os, "close", real_close)
            monkeypatch.setattr(os, "open", real_open)
    t = threading.Thread(target=look)
    t.start()
    t.join()
    assert len(opened) == 1 and closed == opened, (opened, closed)


def test_each_thread_looks_at_its_own_schedstat_and_lets_it_go_when_it_ends():
    import gc
    import os
    from transfer import sockio
    seen = {}

    def look():
        seen["first"] = sockio.waited_for_cpu()  # opens this thread's schedstat
        seen["second"] = sockio.waited_for_cpu()
        stat = sockio._mine.stat
        seen["fd"], seen["tid"] = stat.fd, threading.get_native_id()
        seen["link"] = os.readlink(f"/proc/self/fd/{stat.fd}")
    t = threading.Thread(target=look)
    t.start()
    t.join()
    gc.collect()
    assert seen["first"] is False and seen["second"] in (False, True)
    assert seen["link"].endswith(f"/task/{seen['tid']}/schedstat"), seen
    try:  # the thread ended: its descriptor is closed (or already another file's)
        assert os.readlink(f"/proc/self/fd/{seen['fd']}") != seen["link"]
    except FileNotFoundError:
        pass


@pytest.mark.parametrize("text,cpus,over", [
    (b"0.91 1.54 2.13 3/87 14746\n", 2, True), (b"0.91 1.54 2.13 2/87 14746\n", 2, False),
    (b"0.91 1.54 2.13 1/87 14746\n", 1, False), (b"garbage", 2, False), (b"", 2, False)])
def test_oversubscribed_reads_the_running_count(monkeypatch, tmp_path, text, cpus, over):
    """More threads runnable than this process has CPUs (the caller counts itself)."""
    import os
    from transfer import sockio
    path = tmp_path / "loadavg"
    path.write_bytes(text)
    fd = os.open(path, os.O_RDONLY)
    try:
        monkeypatch.setattr(sockio, "_LOADAVG", fd)
        monkeypatch.setattr(sockio, "_CPUS", cpus)
        assert sockio.oversubscribed() is over
    finally:
        os.close(fd)
    monkeypatch.setattr(sockio, "_LOADAVG", -1)
    assert sockio.oversubscribed() is False
