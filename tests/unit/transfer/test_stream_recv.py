"""The receive loop in C (transfer._stream.recv_into) that kvstore.wire and the tcp
backend use on blocking sockets: it fills the buffer whatever pieces the bytes come in, and
comes back short (for its caller to check a deadline, or meet the error) whenever one call
does: the peer closed, the socket's receive timeout ran out, a signal arrived."""
from __future__ import annotations

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


def test_spin_polls_within_its_window_then_leaves_the_wait_to_the_caller():
    """transfer.sockio.Spin: bytes that come while it polls are received (the window then
    stays at its most), none in time gives None (the caller blocks) and a long wait after
    that halves the window; the peer closing reads as 0; max_s 0 never polls."""
    from transfer import sockio
    a, b = _pair()
    with a, b:
        spin = sockio.Spin(5.0)  # a window no scheduling delay of the timer outlasts
        buf = bytearray(8)
        threading.Timer(0.005, a.send, args=(b"abc",)).start()
        assert spin.poll(b, buf) == 3 and buf[:3] == b"abc" and spin.window_s == 5.0
        spin = sockio.Spin(0.2)
        assert spin.poll(b, buf) is None  # nothing comes: back after the window
        time.sleep(0.25)
        spin.blocked()  # the data came long after: an idle connection polls less
        assert spin.window_s == 0.1
        assert spin.poll(b, buf) is None
        spin.blocked()  # came right after giving up: worth polling longer
        assert spin.window_s == 0.2
        assert sockio.Spin(0).poll(b, buf) is None
        a.close()
        assert spin.poll(b, buf) == 0
