"""A daemon that stalls in the middle of a payload ends the call with RequestTimeout, not
a hang (the receive loop uses MSG_WAITALL, which must not outlast the client's timeout)."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvstore import wire as w
from kvstore.client import Client, ConnectError, RequestTimeout
from kvstore.keys import Namespace, hash_blocks

NS = Namespace("timeout-test", num_layers=1, num_kv_heads=1, head_dim=64)  # 4 KiB blocks


def stalling_daemon(listener: socket.socket, stop: threading.Event) -> None:
    """Speaks HELLO, then answers a GET with one hit whose bytes stop after 100."""
    conn, _ = listener.accept()
    with conn:
        reader = w.FrameReader(conn)
        reader.frame(1 << 20)
        w.send_frame(conn, w.HelloOk(block_bytes=NS.block_bytes), w.Op.HELLO, True)
        reader.frame(1 << 20)
        conn.sendall(w.encode(w.GetOk(tiers=b"\x01"), w.Op.GET, True, NS.block_bytes))
        conn.sendall(b"\0" * 100)
        stop.wait(30)


def test_a_payload_that_stops_midway_times_out():
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    server = threading.Thread(target=stalling_daemon, args=(listener, stop), daemon=True)
    server.start()
    try:
        port = listener.getsockname()[1]
        with Client(f"kvtier://127.0.0.1:{port}", namespace=NS, timeout_s=0.5,
                    use_shm=False) as c:
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout, match="stalled"):
                c.get_n(hash_blocks(NS, np.arange(16)), np.zeros((1, NS.block_bytes), np.uint8))
            assert time.monotonic() - t0 < 5
    finally:
        stop.set()
        listener.close()
        server.join(5)


def naming_daemon(listener: socket.socket, stop: threading.Event) -> None:
    """Speaks HELLO, then answers a GET naming a tier that does not exist (on every
    connection: the client retries a call once on a fresh one)."""
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except (socket.timeout, OSError):
            continue
        with conn:
            reader = w.FrameReader(conn)
            reader.frame(1 << 20)
            w.send_frame(conn, w.HelloOk(block_bytes=NS.block_bytes), w.Op.HELLO, True)
            reader.frame(1 << 20)
            conn.sendall(w.encode(w.GetOk(tiers=b"\x7f"), w.Op.GET, True, 0))


def test_a_reply_naming_an_unknown_tier_is_a_protocol_error():
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    server = threading.Thread(target=naming_daemon, args=(listener, stop), daemon=True)
    server.start()
    try:
        port = listener.getsockname()[1]
        with Client(f"kvtier://127.0.0.1:{port}", namespace=NS, timeout_s=2,
                    use_shm=False) as c:
            # (a ProtocolError drops the connection; the retry on a fresh one meets the same
            # reply, and the call ends with it, named)
            with pytest.raises(ConnectError, match="unknown tier 127"):
                c.get_n(hash_blocks(NS, np.arange(16)), np.zeros((1, NS.block_bytes), np.uint8))
    finally:
        stop.set()
        listener.close()
        server.join(5)
