"""The data-plane codec: round trips, clear errors, and a Hypothesis fuzz of the decoder."""
from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvstore import wire as w
from transfer import sockio

MESSAGES = [w.Hello(token="t", model="m", num_layers=1, num_kv_heads=1, head_dim=64,
                    dtype="float16", block_tokens=16, revision="main", tenant="a"),
            w.Put(hashes=b"h" * 32), w.Get(hashes=b"g" * 16, shm=True, release=(3, 4)),
            w.Reserve(hashes=b"r" * 16), w.Commit(reservation_id=7), w.Abort(reservation_id=7),
            w.Exists(hashes=b""), w.Match(hashes=b"m" * 48), w.Remove(hashes=b"x" * 16),
            w.Pin(hashes=b"p" * 16, ttl_s=1.5), w.Pin(hashes=b"p" * 16), w.Unpin(hashes=b""),
            w.Release(lease_ids=(1,)), w.Stats()]


def decode(raw: bytes, max_payload: int = 1 << 30) -> w.Message:
    op, reply, header_len, payload_len = w.decode_prefix(raw[:w.PREFIX.size], max_payload)
    return w.decode_header(op, reply, raw[w.PREFIX.size:w.PREFIX.size + header_len])


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_requests_round_trip(msg):
    assert decode(w.encode(msg, msg.OP, False)) == msg


def test_replies_round_trip():
    for op, msg in [(w.Op.GET, w.GetOk(tiers=b"\x01\xff", lease_id=3, slots=b"\0" * 16)),
                    (w.Op.STATS, w.StatsOk(misses=1, tiers=((1, 2, 3),))),
                    (w.Op.EXISTS, w.Ack(flags=b"\x01")), (w.Op.ERROR, w.Error(code=2, message="x"))]:
        assert decode(w.encode(msg, op, True)) == msg


def test_stats_carry_the_error_counts_to_the_client():
    """Client.stats().write_errors and background_errors read what the daemon counted
    (they were always 0: the reply had no fields for them)."""
    from kvstore.client.replies import stats_of
    from kvstore.keys import Namespace
    reply = decode(w.encode(w.StatsOk(write_errors=10, background_errors=2), w.Op.STATS, True))
    stats = stats_of(reply, Namespace("m", 1, 1, 64))
    assert (stats.write_errors, stats.background_errors) == (10, 2)


def test_clear_errors():
    good = w.encode(w.Stats(), w.Op.STATS, False)
    with pytest.raises(w.ProtocolError, match="magic"):
        decode(b"XXXX" + good[4:])
    with pytest.raises(w.ProtocolError, match="version 9") as e:
        decode(w.PREFIX.pack(w.MAGIC, 9, w.Op.STATS, 0, 0))
    assert e.value.code is w.ErrorCode.VERSION
    with pytest.raises(w.ProtocolError, match="limit") as e:
        decode(w.PREFIX.pack(w.MAGIC, w.PROTOCOL_VERSION, w.Op.PUT, 1, 1 << 31))
    assert e.value.code is w.ErrorCode.TOO_LARGE
    with pytest.raises(w.ProtocolError, match="multiple of 16"):
        w.Put(hashes=b"short")
    import msgspec
    bad = msgspec.msgpack.encode(["7"])  # a Commit whose reservation id is a string
    with pytest.raises(w.ProtocolError, match="Expected `int`"):
        w.decode_header(w.Op.COMMIT, False, bad)
    with pytest.raises(w.ProtocolError, match="Expected `array`"):
        w.decode_header(w.Op.COMMIT, False, msgspec.msgpack.encode({"reservation_id": 7}))
    with pytest.raises(w.ProtocolError, match="at most"):
        w.decode_header(w.Op.COMMIT, False, msgspec.msgpack.encode([7, 8]))


def test_send_frame_gathers_payload():
    a, b = socket.socketpair()
    with a, b:
        w.send_frame(a, w.Put(hashes=b"h" * 16), w.Op.PUT, False, [b"x" * 1000, bytearray(24)])
        frame = w.recv_frame(b, 1 << 20)
        assert frame.payload_bytes == 1024 and frame.msg.hashes == b"h" * 16
        buf = bytearray(1024)
        w.recv_exact(b, memoryview(buf))
        assert buf[:1000] == b"x" * 1000


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_payload_starts_64_byte_aligned_in_its_frame(msg):
    """Whatever its header's length, a frame with a payload is padded with zero bytes to a
    multiple of sockio.PAYLOAD_ALIGN (the receiving kernel's copy of a payload at another offset
    than its aligned destination ran at about half speed); one without is not padded."""
    bare = w.encode(msg, msg.OP, False)
    padded = w.encode(msg, msg.OP, False, 4096)
    align = sockio.PAYLOAD_ALIGN
    assert len(padded) % align == 0 and len(padded) - len(bare) < align
    assert padded[len(bare):] == bytes(len(padded) - len(bare))
    assert padded[w.PREFIX.size:len(bare)] == bare[w.PREFIX.size:]  # the same header
    a, b = socket.socketpair()
    with a, b:
        payload = bytes(range(256)) * 16
        a.sendall(padded + payload + bare)
        reader = w.FrameReader(b)
        frame = reader.frame(1 << 20)
        assert frame.msg == msg and frame.payload_bytes == 4096
        got = bytearray(4096)
        reader.recv_into(memoryview(got))
        assert got == payload  # not shifted by the pad
        assert reader.frame(1 << 20).msg == msg  # the next frame, in step
        a.sendall(padded + payload)
        assert w.recv_frame(b, 1 << 20).msg == msg
        w.recv_exact(b, memoryview(got))
        assert got == payload


def test_an_unpadded_payload_is_a_protocol_error_not_shifted_bytes():
    """A sender that does not pad (an older protocol's framing written by hand) has its
    payload's first bytes where the pad goes: refused, rather than its block stored with
    its bytes shifted."""
    msg = w.Put(hashes=b"h" * 16)
    bare = w.encode(msg, msg.OP, False)
    head = w.PREFIX.pack(w.MAGIC, w.PROTOCOL_VERSION, w.Op.PUT, len(bare) - w.PREFIX.size, 64)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(head + bare[w.PREFIX.size:] + b"\x07" * 64)
        with pytest.raises(w.ProtocolError, match="must be zero"):
            w.FrameReader(b).frame(1 << 20)


def test_recv_exact_fills_a_view_of_several_chunks_sent_in_odd_pieces():
    import threading
    n = 3 * w.RECV_CHUNK + 12_345  # not a whole number of chunks
    data = bytes(np.random.default_rng(7).integers(0, 256, n, np.uint8))
    a, b = socket.socketpair()
    with a, b:
        def send():
            for lo in range(0, n, 40_001):  # pieces that straddle the chunk edges
                a.sendall(data[lo:lo + 40_001])
        t = threading.Thread(target=send)
        t.start()
        buf = bytearray(n)
        w.recv_exact(b, memoryview(buf))
        t.join()
        assert bytes(buf) == data


def test_recv_exact_past_its_first_chunk_raises_when_the_peer_closes():
    a, b = socket.socketpair()
    with b:
        a.sendall(b"y" * (w.RECV_CHUNK + 10))
        a.close()
        buf = bytearray(2 * w.RECV_CHUNK)
        with pytest.raises(ConnectionError, match="mid-frame"):
            w.recv_exact(b, memoryview(buf))
        assert buf[:w.RECV_CHUNK + 10] == b"y" * (w.RECV_CHUNK + 10)


@pytest.mark.parametrize("loop", ["C", "Python"])
def test_recv_exact_gives_up_at_its_deadline_on_a_peer_that_never_goes_quiet(
        loop, monkeypatch, trickling_peer):
    """A peer sending a byte every 20 ms never lets one receive time out for long, yet the
    deadline holds: the loop (in C or not) hands back at each socket timeout to check it.
    (Should a busy host stall the sender past the socket's timeout at the deadline, that
    call's own timeout ends it instead: BlockingIOError. Either way it does not wait for
    the megabyte.)"""
    import time
    if loop == "Python":
        monkeypatch.setattr(sockio, "recv_loop", None)
    elif sockio.recv_loop is None:
        pytest.fail("transfer._stream is missing: reinstall kvtier with a C compiler")
    a, b = socket.socketpair()
    w.kernel_timeouts(b, 0.2)
    with a, b, trickling_peer(a) as gave_up:
        with pytest.raises((TimeoutError, BlockingIOError)):
            w.recv_exact(b, memoryview(bytearray(1 << 20)), time.monotonic() + 0.5)
        assert not gave_up.is_set(), "it waited for the peer to give up"


class _CountingSocket(socket.socket):
    """A socket that counts the timeouts set on it (SO_RCVTIMEO / SO_SNDTIMEO)."""
    sets = 0

    def setsockopt(self, level, option, value, *rest):
        if level == socket.SOL_SOCKET and option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self.sets += 1
        return super().setsockopt(level, option, value, *rest)


@pytest.mark.parametrize("loop", ["C", "Python"])
def test_a_slow_payload_within_its_deadline_sets_the_timeout_a_few_times_not_per_read(
        loop, monkeypatch):
    """Past the point where a deadline is nearer than the socket's standing timeout, each
    receive is bounded by the time left: set again once per DEADLINE_SLACK_S gone by, not
    once per read (a 4 MiB payload coming a chunk every 2 ms took 64 setsockopt calls)."""
    import threading
    import time
    if loop == "Python":
        monkeypatch.setattr(sockio, "recv_loop", None)
    a, raw_b = socket.socketpair()
    b = _CountingSocket(fileno=raw_b.detach())
    w.kernel_timeouts(b, 30.0)
    pieces, piece = 64, w.RECV_CHUNK
    with a, b:
        def send():
            for _ in range(pieces):
                a.sendall(b"p" * piece)
                time.sleep(0.002)
        t = threading.Thread(target=send)
        t0 = time.monotonic()
        t.start()
        got = bytearray(pieces * piece)
        changed = w.recv_exact(b, memoryview(got), time.monotonic() + 20.0, 30.0)
        elapsed = time.monotonic() - t0
        t.join()
        assert got == b"p" * len(got) and changed
        assert b.sets <= elapsed / w.DEADLINE_SLACK_S + 2, (b.sets, elapsed)


@given(st.binary(max_size=300))
def test_fuzz_decoder_any_bytes_decode_or_protocol_error(raw):
    try:
        decode(raw.ljust(w.PREFIX.size, b"\0"))
    except w.ProtocolError:
        pass


@given(st.sampled_from(list(w.Op)), st.booleans(), st.binary(max_size=200))
def test_fuzz_header_after_valid_prefix(op, reply, header):
    try:
        w.decode_header(int(op), reply, header)
    except w.ProtocolError:
        pass


def test_frame_reader_keeps_bytes_read_past_a_header():
    """Prefix + header come in one recv; payload bytes (or a whole next frame) read with
    them are handed out first, whatever way the stream is split."""
    first = w.encode(w.Put(hashes=b"a" * 16), w.Op.PUT, False, 40_000)
    payload = bytes(range(256)) * 156 + bytes(64)  # 40,000 bytes
    second = w.encode(w.Exists(hashes=b"b" * 32), w.Op.EXISTS, False)
    stream = first + payload + second
    for cut in (1, 7, 20, 25, 1000, len(first) + 3, len(stream)):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(stream[:cut])
            reader = w.FrameReader(b)
            sender = __import__("threading").Thread(target=a.sendall, args=(stream[cut:],))
            sender.start()
            frame = reader.frame(1 << 20)
            assert frame.msg.hashes == b"a" * 16 and frame.payload_bytes == 40_000
            got = bytearray(40_000)
            reader.recv_into(memoryview(got)[:12_345])
            reader.recv_into(memoryview(got)[12_345:])
            assert bytes(got) == payload
            assert reader.frame(1 << 20).msg.hashes == b"b" * 32
            sender.join()


def test_frame_reader_hands_out_frames_of_any_size_from_one_stream():
    """Many frames back to back (small ones, a header bigger than the reader's buffer,
    payloads split across its refills), sent at once or a few bytes at a time: each frame
    and each payload byte comes out in order, and the buffer shrinks back after."""
    rng = np.random.default_rng(5)
    frames = []
    for k in range(40):
        nh = int(rng.choice([1, 3, 2500]))  # 2500 hashes: a 40 KB header
        payload = rng.integers(0, 256, int(rng.choice([0, 100, 20_000, 70_000])),
                               np.uint8).tobytes()
        frames.append((bytes([k]) * 16 * nh, payload))
    stream = b"".join(w.encode(w.Put(hashes=h), w.Op.PUT, False, len(p)) + p
                      for h, p in frames)
    for step in (len(stream), 4093):
        a, b = socket.socketpair()
        with a, b:
            def send():
                for i in range(0, len(stream), step):
                    a.sendall(stream[i:i + step])
            sender = __import__("threading").Thread(target=send)
            sender.start()
            reader = w.FrameReader(b)
            for hashes, payload in frames:
                frame = reader.frame(1 << 20)
                assert frame.msg.hashes == hashes and frame.payload_bytes == len(payload)
                got = bytearray(len(payload))
                if payload:
                    reader.recv_into(memoryview(got))
                assert bytes(got) == payload
            sender.join()
            # a 40 KB header grew the buffer; once drained it is CHUNK again (a connection
            # that sent one big request does not keep a big buffer for its life)
            assert reader.buffered.capacity == w.FrameBuffer.CHUNK


def test_a_frame_buffer_grows_with_what_arrives_not_with_what_a_header_announces():
    """A prefix announcing a 1 MiB header grew the buffer to 1 MiB at once: 300 connections
    that sent one byte more made a daemon hold 311 MiB (kept by its tuned heap after they
    closed). It grows only once full, doubling, so it holds about what has arrived."""
    buf = w.FrameBuffer()
    n, fed = 1 << 20, bytearray()
    view = buf.room(n)
    assert buf.capacity == w.FrameBuffer.CHUNK  # nothing arrived: nothing grown
    view[:1] = b"x"
    buf.received(1)
    assert buf.capacity == w.FrameBuffer.CHUNK
    while buf.pending() < n:
        view = buf.room(n)
        k = min(len(view), n - buf.pending(), 5000)
        chunk = bytes((len(fed) + i) % 251 for i in range(k))
        view[:k] = chunk
        fed += chunk
        buf.received(k)
        assert buf.capacity <= 2 * (buf.pending() + w.FrameBuffer.CHUNK)
    assert buf.take(1) == b"x" and buf.take(len(fed)) == bytes(fed)
    assert buf.capacity == w.FrameBuffer.CHUNK  # drained: back to its first size
    buf.load(b"y" * (40 << 10))  # bytes received elsewhere, bigger than the buffer
    assert buf.take(40 << 10) == b"y" * (40 << 10)


def test_frame_reader_reports_a_peer_that_closes_mid_frame():
    a, b = socket.socketpair()
    with b:
        a.sendall(w.encode(w.Stats(), w.Op.STATS, False)[:10])
        a.close()
        with pytest.raises(ConnectionError, match="mid-frame"):
            w.FrameReader(b).frame(1 << 20)


def test_hashes_pack_from_any_buffers_and_unpack_one_or_many():
    hs = [bytes([i]) * 16 for i in range(3)]
    forms = [hs, tuple(hs), [bytearray(h) for h in hs], [memoryview(h) for h in hs],
             [np.frombuffer(h, np.uint8) for h in hs],
             np.frombuffer(b"".join(hs), np.uint8).reshape(3, 16)]
    for form in forms:
        packed = w.pack_hashes(form)
        assert packed == b"".join(hs) and type(packed) is bytes
        assert w.Get(hashes=packed).hash_list == hs
    assert w.Get(hashes=hs[0]).hash_list == [hs[0]]  # one block: the request's own bytes
    assert w.Get(hashes=b"").hash_list == []
    for bad in ([b"short"], [hs[0], hs[1][:15]], ["not bytes" * 2]):
        with pytest.raises((ValueError, TypeError)):
            w.pack_hashes(bad)
