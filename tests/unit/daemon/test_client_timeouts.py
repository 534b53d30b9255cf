"""A daemon that misbehaves after HELLO: one that stalls in the middle of a payload ends
the call with RequestTimeout, not a hang (the receive loop uses MSG_WAITALL, which must not
outlast the client's timeout); one whose reply names a tier that does not exist ends it
with an error that says so."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Callable, Iterator

import numpy as np
import pytest

from kvstore import wire as w
from kvstore.client import Client, ConnectError, RequestTimeout
from kvstore.keys import Namespace, hash_blocks

NS = Namespace("timeout-test", num_layers=1, num_kv_heads=1, head_dim=64)  # 4 KiB blocks


@contextlib.contextmanager
def fake_daemon(answer_get: Callable[[socket.socket, threading.Event], None],
                max_payload_bytes: int = 0) -> Iterator[str]:
    """A daemon on a loopback port that speaks HELLO and then answers the first request
    of every connection with `answer_get(conn, stop)` (the client retries some failures
    once on a fresh connection). Yields its url."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # a timeout to look at `stop` again, or the listener closed
                continue
            with conn:
                reader = w.FrameReader(conn)
                reader.frame(1 << 20)
                w.send_frame(conn, w.HelloOk(block_bytes=NS.block_bytes,
                                             max_payload_bytes=max_payload_bytes),
                             w.Op.HELLO, True)
                reader.frame(max(1 << 20, max_payload_bytes))
                answer_get(conn, stop)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield f"kvtier://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        server.join(5)


def get_one(c: Client) -> None:
    c.get_n(hash_blocks(NS, np.arange(16)), np.zeros((1, NS.block_bytes), np.uint8))


def stall_midway(conn: socket.socket, stop: threading.Event) -> None:
    """One hit whose bytes stop after 100."""
    conn.sendall(w.encode(w.GetOk(tiers=b"\x01"), w.Op.GET, True, NS.block_bytes))
    conn.sendall(b"\0" * 100)
    stop.wait(30)


def name_unknown_tier(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(w.encode(w.GetOk(tiers=b"\x7f"), w.Op.GET, True, 0))


def test_a_payload_that_stops_midway_times_out():
    with fake_daemon(stall_midway) as url, \
            Client(url, namespace=NS, timeout_s=0.5, use_shm=False) as c:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout, match="stalled"):
            get_one(c)
        assert time.monotonic() - t0 < 5


def read_slowly(conn: socket.socket, stop: threading.Event) -> None:
    """Take a request's payload 256 KiB every 50 ms (about 5 MiB/s, so each of the
    client's sendmsg calls makes some progress well within its timeout), for up to 30 s."""
    buf = bytearray(256 << 10)
    until = time.monotonic() + 30
    while not stop.is_set() and time.monotonic() < until:
        try:
            if not conn.recv_into(buf):
                return
        except OSError:
            return
        stop.wait(0.05)


def test_a_daemon_taking_a_put_slowly_cannot_stretch_the_timeout():
    """The request goes out whole within timeout_s, or the call ends: SO_SNDTIMEO alone
    times each sendmsg, and a peer that takes a little now and then restarted it at every
    call (64 MiB at ~5 MiB/s: ~13 s, then "no reply", against a 0.5 s timeout)."""
    payload = np.zeros((1024, NS.block_bytes * 16), np.uint8)  # 64 MiB
    with fake_daemon(read_slowly, max_payload_bytes=payload.nbytes) as url, \
            Client(url, namespace=NS, timeout_s=0.5, use_shm=False) as c:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout, match="stalled"):
            c.put_n(hash_blocks(NS, np.arange(16 * 1024 * 16)), payload.reshape(-1, NS.block_bytes))
        assert time.monotonic() - t0 < 10


def dribble(data: bytes, conn: socket.socket, stop: threading.Event) -> None:
    """Send `data` a byte every 50 ms (each read of the client's makes some progress well
    within its timeout), for up to 30 s."""
    until = time.monotonic() + 30
    for i in range(len(data)):
        if stop.is_set() or time.monotonic() > until:
            return
        try:
            conn.sendall(data[i:i + 1])
        except OSError:
            return
        stop.wait(0.05)


def dribble_reply(conn: socket.socket, stop: threading.Event) -> None:
    """One hit's reply header, a byte at a time."""
    dribble(w.encode(w.GetOk(tiers=b"\x01"), w.Op.GET, True, NS.block_bytes), conn, stop)


def dribble_payload(conn: socket.socket, stop: threading.Event) -> None:
    """One hit's reply header at once, then its payload a byte at a time."""
    conn.sendall(w.encode(w.GetOk(tiers=b"\x01"), w.Op.GET, True, NS.block_bytes))
    dribble(bytes(NS.block_bytes), conn, stop)


@pytest.mark.parametrize("answer", [dribble_reply, dribble_payload])
def test_a_daemon_dribbling_its_reply_cannot_stretch_the_timeout(answer):
    """A reply's header comes within timeout_s of the request, and each payload read
    within timeout_s, however the daemon paces its bytes: the socket's timeout alone was
    restarted by every byte (a reply dribbled at 20 bytes/s held the call for good)."""
    with fake_daemon(answer) as url, \
            Client(url, namespace=NS, timeout_s=0.5, use_shm=False) as c:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            get_one(c)
        assert time.monotonic() - t0 < 10


def test_a_reply_naming_an_unknown_tier_is_a_protocol_error():
    with fake_daemon(name_unknown_tier) as url, \
            Client(url, namespace=NS, timeout_s=2, use_shm=False) as c:
        # (a ProtocolError drops the connection; the retry on a fresh one meets the same
        # reply, and the call ends with it, named)
        with pytest.raises(ConnectError, match="unknown tier 127"):
            get_one(c)
