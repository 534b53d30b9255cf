"""The tcp backend's framing and socket I/O.

A frame is a fixed 20-byte head, a msgpack header, then `payload_len` raw bytes:
    head = magic "KVTX" | version u8 | kind u8 | reserved u16 | header_len u32 | payload_len u64
A frame with a payload pads its header with zero bytes to a multiple of 64 from the frame's
start (`header_pad`: see sockio.PAYLOAD_ALIGN).
Payload bytes never pass through msgpack: they are sent with `sendmsg` from, and received with
`recvmsg_into` straight into, the registered buffers. Descriptor arrays travel as raw int64
bytes inside the header, so a batch of any size is decoded without a Python loop.

Every blocking call polls at POLL_S and gives up when the connection made no progress for
`io_timeout_s`, so a silent peer costs a bounded wait, never a hang. The sockets block, with
POLL_S as their kernel timeouts (`tune`): a socket with a Python timeout is non-blocking
underneath, a poll and a recv for every segment that arrives, and its receives cannot wait
for a whole chunk (MSG_WAITALL).
"""
from __future__ import annotations

import enum
import socket
import struct
import time
from typing import Callable, Sequence

import msgpack
import numpy as np

from .. import sockio
from ..errors import Fault, TransferError

MAGIC = b"KVTX"
WIRE_VERSION = 2  # 2: a payload starts 64-byte aligned
HEAD = struct.Struct("<4sBBHIQ")
MAX_HEADER_BYTES = 1 << 26
MAX_HELLO_BYTES = 1 << 10  # a HELLO (before the peer is known) is small
POLL_S = 0.2
IOV_MAX = 512
RECV_CHUNK = 64 << 10  # a big buffer is received this much a call (as kvstore.wire does)
TIMED_OUT = (socket.timeout, BlockingIOError)  # a kernel timeout raises the second


class Kind(enum.IntEnum):
    HELLO = 1  # [target agent_id, sender name, access key]
    WRITE = 2  # [seq, ids, offsets, lengths, notify|None] + payload
    READ = 3  # [seq, ids, offsets, lengths, notify|None]
    NOTIFY = 4  # [seq, payload]
    ACK = 5  # [seq]
    DATA = 6  # [seq] + payload
    ERROR = 7  # [seq, fault name, message]


class Progress:
    """Last time a connection moved a byte either way (shared by its threads)."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = time.monotonic()


def frame(kind: Kind, header: list, payload_len: int = 0) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    head = HEAD.pack(MAGIC, WIRE_VERSION, int(kind), 0, len(body), payload_len) + body
    return head + sockio.PAD[:header_pad(len(body), payload_len)] if payload_len else head


def header_pad(header_len: int, payload_len: int) -> int:
    """Zero bytes between a frame's header and its payload (none without a payload)."""
    return sockio.payload_pad(HEAD.size + header_len) if payload_len else 0


def protocol_error(msg: str) -> TransferError:
    return TransferError(Fault.PROTOCOL, msg)


def parse_head(head: bytes, max_payload: int,
               max_header: int = MAX_HEADER_BYTES) -> tuple[Kind, int, int]:
    magic, version, kind, _, hlen, plen = HEAD.unpack(head)
    if magic != MAGIC or version != WIRE_VERSION:
        raise protocol_error(f"bad frame magic/version {magic!r}/{version}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise protocol_error(f"unknown frame kind {kind}") from None
    if hlen > max_header or plen > max_payload:
        raise protocol_error(f"frame too large (header {hlen}, payload {plen})")
    return kind, hlen, plen


def parse_header(body: bytes, kind: Kind) -> list:
    try:
        header = msgpack.unpackb(body, raw=False, use_list=True, max_map_len=0,
                                 max_ext_len=0, max_array_len=64)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise protocol_error(f"undecodable {kind.name} header: {e}") from e
    if not isinstance(header, list) or not header:
        raise protocol_error(f"{kind.name} header is not a list")
    return header


def desc_arrays(header: list) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, bytes | None]:
    """[seq, ids, offsets, lengths, notify] → typed values, checked for shape only."""
    try:
        seq, ids, offs, lens, note = header
        arrays = [np.frombuffer(b, dtype="<i8") for b in (ids, offs, lens)]
    except (ValueError, TypeError) as e:
        raise protocol_error(f"bad descriptor header: {e}") from e
    if not (arrays[0].size == arrays[1].size == arrays[2].size) or not isinstance(seq, int):
        raise protocol_error("descriptor arrays of different lengths")
    if note is not None and not isinstance(note, bytes):
        raise protocol_error("notification is not bytes")
    return seq, arrays[0], arrays[1], arrays[2], note


def _wait_or_raise(progress: Progress, timeout_s: float, stopped: Callable[[], bool],
                   idle: bool) -> None:
    if stopped():
        raise TransferError(Fault.CLOSED, "connection closed locally")
    if idle:
        progress.t = time.monotonic()
    elif time.monotonic() - progress.t > timeout_s:
        raise TransferError(Fault.TIMEOUT, f"no progress on the connection for {timeout_s}s")


def _advance(bufs: list[memoryview], i: int, n: int) -> int:
    while n:
        if n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        else:
            bufs[i] = bufs[i][n:]
            n = 0
    return i


def recv_views(sock: socket.socket, views: Sequence, progress: Progress, timeout_s: float,
               stopped: Callable[[], bool], idle_ok: bool = False) -> None:
    """Fill every view completely. `idle_ok`: waiting before the first byte is not a stall."""
    bufs = [memoryview(v).cast("B") for v in views if len(v)]
    i, started = 0, False
    fd = sockio.loop_fd(sock)
    while i < len(bufs):
        try:
            if len(bufs[i]) >= RECV_CHUNK and fd >= 0:  # the calls below, looped in C
                n = sockio.recv_loop(fd, bufs[i], RECV_CHUNK)
            elif len(bufs[i]) >= RECV_CHUNK:  # the kernel fills a whole chunk per call
                n = sock.recv_into(bufs[i], RECV_CHUNK, socket.MSG_WAITALL)
            else:  # small ones gathered, what has arrived
                n = sock.recvmsg_into(bufs[i:i + IOV_MAX])[0]
        except TIMED_OUT:
            _wait_or_raise(progress, timeout_s, stopped, idle_ok and not started)
            continue
        except OSError as e:
            raise TransferError(Fault.CONNECTION_LOST, f"receive failed: {e}") from e
        if n == 0:
            raise TransferError(Fault.CONNECTION_LOST, "peer closed the connection")
        started = True
        progress.t = time.monotonic()
        i = _advance(bufs, i, n)


def send_views(sock: socket.socket, views: Sequence, progress: Progress, timeout_s: float,
               stopped: Callable[[], bool]) -> None:
    bufs = [memoryview(v).cast("B") for v in views if len(v)]
    i = 0
    while i < len(bufs):
        try:
            n = sock.sendmsg(bufs[i:i + IOV_MAX])
        except TIMED_OUT:
            _wait_or_raise(progress, timeout_s, stopped, False)
            continue
        except OSError as e:
            raise TransferError(Fault.CONNECTION_LOST, f"send failed: {e}") from e
        progress.t = time.monotonic()
        i = _advance(bufs, i, n)


def recv_frame(sock: socket.socket, progress: Progress, timeout_s: float,
               stopped: Callable[[], bool], max_payload: int, idle_ok: bool,
               max_header: int = MAX_HEADER_BYTES,
               spin: sockio.Spin | None = None) -> tuple[Kind, list, int]:
    """Read one frame's head and header; the caller reads `payload_len` bytes after it.
    `spin`: poll for the head before sleeping in the receive (an admitted peer's only)."""
    head = bytearray(HEAD.size)
    try:
        got = spin.poll(sock, head) if spin is not None else None
    except OSError as e:
        raise TransferError(Fault.CONNECTION_LOST, f"receive failed: {e}") from e
    if got is None:
        recv_views(sock, [head], progress, timeout_s, stopped, idle_ok)
        if spin is not None:
            spin.blocked()
    elif got == 0:
        raise TransferError(Fault.CONNECTION_LOST, "peer closed the connection")
    else:
        progress.t = time.monotonic()
        recv_views(sock, [memoryview(head)[got:]], progress, timeout_s, stopped)
    kind, hlen, plen = parse_head(bytes(head), max_payload, max_header)
    body = bytearray(hlen + header_pad(hlen, plen))
    recv_views(sock, [body], progress, timeout_s, stopped)
    if not sockio.pad_is_zero(body, hlen):  # a sender that did not pad: its payload
        raise protocol_error(f"{kind.name}: the bytes between header and payload must be "
                             "zero (the frame's payload starts 64-byte aligned)")
    return kind, parse_header(bytes(body[:hlen]), kind), plen


def drain(sock: socket.socket, nbytes: int, progress: Progress, timeout_s: float,
          stopped: Callable[[], bool]) -> None:
    """Read and drop `nbytes` (the payload of a request that was refused)."""
    scratch = bytearray(min(nbytes, 1 << 20))
    while nbytes:
        n = min(nbytes, len(scratch))
        recv_views(sock, [memoryview(scratch)[:n]], progress, timeout_s, stopped)
        nbytes -= n


def tune(sock: socket.socket, buf_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, buf_bytes)
    sock.settimeout(None)
    tv = struct.pack("ll", int(POLL_S), int(POLL_S % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
