"""The daemon's data-plane protocol: framing, messages and the errors both ends raise.

A frame is a fixed 20-byte prefix, a msgpack header, then raw payload bytes:

    magic "KVTW" | version u16 | op u16 | header_len u32 | payload_len u64
    header: msgpack array of the message's fields (in declaration order; msgspec Structs)
    pad: a frame with a payload only, zero bytes up to a multiple of 64 from the frame's
         start (`header_pad`, transfer.sockio.PAYLOAD_ALIGN; the receiver checks and drops them)
    payload: block bytes, back to back (never inside msgpack: ~1 GB/s vs ~4 GB/s raw)

Every request gets exactly one reply frame: the same op with the REPLY bit, or ERROR. Block
hashes travel as one bytes field of n x 16 bytes, per-block statuses and tiers as one byte
each, slots as little-endian int64s, so a 1,000-block batch is a handful of msgpack items.
A frame that cannot be decoded raises `ProtocolError`; the daemon answers with an ERROR
frame and closes only that connection.

Limits hold while decoding, before any object is built from untrusted bytes: a header is
at most MAX_HELLO_HEADER_BYTES until the connection has authenticated (only HELLO is
served before that) and MAX_HEADER_BYTES after; msgspec decodes it straight into the
message's typed fields, so a map, a value of the wrong type or a field too many is refused
before anything else is built (encode + decode ~0.4 us a message, ~7 us with a hand-checked
msgpack list).

Same-host connections come over a Unix-domain socket; there the replies to SHARE (the DRAM
arena and its slot directory) and STAGE (a staging segment) carry file descriptors
(SCM_RIGHTS) attached to the reply frame's first byte.
"""
from __future__ import annotations

import array
import enum
import os
import re
import socket
import struct
import time
from typing import ClassVar

import msgspec

from kvstore.errors import KVStoreError
from kvstore.keys import HASH_BYTES
from transfer import sockio

PROTOCOL_VERSION = 7  # 7: a payload starts 64-byte aligned (6: STATS carries the error
# counts; 5: TOUCH read counts, FLUSH a batch's want; 4: HELLO, the codec)
MAGIC = b"KVTW"
PREFIX = struct.Struct("<4sHHIQ")
MAX_HEADER_BYTES = 1 << 20
MAX_HELLO_HEADER_BYTES = 16 << 10  # everything a connection may send before it authenticates
MAX_FDS = 4  # descriptors one reply frame may carry
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
REPLY = 0x8000
MISS = 255  # tier byte of a block that was not found
NO_SLOT = -1


class Op(enum.IntEnum):
    HELLO = 1
    PUT = 2
    GET = 3
    RESERVE = 4
    COMMIT = 5
    ABORT = 6
    EXISTS = 7
    MATCH = 8
    REMOVE = 9
    PIN = 10
    UNPIN = 11
    RELEASE = 12
    STATS = 13
    TOUCH = 14
    STAGE = 15
    SHARE = 16
    PUTS = 17       # open this connection's put channel (same host): ring + doorbell fds
    FLUSH = 18      # commit what this connection's put channel holds, now
    ERROR = 0x7FFF


class ErrorCode(enum.IntEnum):
    PROTOCOL = 1        # malformed frame, unknown op, bad field
    VERSION = 2         # protocol version this daemon does not speak
    TOO_LARGE = 3       # header or payload length over the limit
    AUTH = 4            # missing or wrong token
    FORBIDDEN = 5       # the token's tenant may not use that namespace
    NAMESPACE = 6       # bad namespace, or too many namespaces
    BLOCK_SIZE = 7      # payload not n x block_bytes
    RESERVATION = 8     # unknown / expired reservation
    UNAVAILABLE = 9     # daemon shutting down, or at its connection limit
    INTERNAL = 10
    QUOTA = 11          # the tenant's namespace or byte quota is used up
    NO_SPACE = 12       # a tier could not store the blocks (disk full, I/O error): none stored


class ProtocolError(KVStoreError):
    """Bytes on the data plane that are not a valid frame (or a frame out of place)."""

    code = ErrorCode.PROTOCOL

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL) -> None:
        super().__init__(message)
        self.code = code


class RemoteError(KVStoreError):
    """The daemon refused a request; `code` says why (an ErrorCode)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name.lower()}: {message}")
        self.code = code


class AuthError(RemoteError):
    """The daemon wants a (different) token, or the token's tenant may not use the namespace."""


# SO_SNDBUF / SO_RCVBUF of data-plane sockets, both ends (the kernel doubles it). Small
# enough that a big transfer's two copies (sender -> kernel, kernel -> receiver) overlap
# on two cores instead of the first filling the buffers before the second starts.
# Measured on loopback against 4 MiB, the runs alternating: 16 x 256 KiB puts 3.5-3.8 ->
# 4.15-4.2 GB/s, 16 x 4 MiB puts 3.1-3.8 -> 4.1-4.4 and gets 3.4-3.8 -> 4.5-4.9, the rest
# level; 512 KiB cost the gets a fifth, 2 MiB kept part of the loss. (Under two busy
# processes both sizes varied run to run more than they differed.)
SOCKET_BUF_BYTES = 1 << 20


def size_buffers(sock: socket.socket) -> None:
    """Both of a data-plane socket's buffers at SOCKET_BUF_BYTES (daemon and clients)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUF_BYTES)


def netloc(host: str, port: int) -> str:
    """HOST:PORT for a URL: an IPv6 address in brackets (`[::1]:7481`, which `parse_url`
    and any URL parser read back; `::1:7481` is not an address)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def remote_error(code: ErrorCode, message: str) -> RemoteError:
    cls = AuthError if code in (ErrorCode.AUTH, ErrorCode.FORBIDDEN) else RemoteError
    return cls(code, message)


# ------------------------------------------------------------------------ messages

class Message(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Base of every wire message: a msgspec Struct encoded as a msgpack array of its fields
    in declaration order (the protocol version travels in the frame prefix). msgspec checks
    every field's type while decoding, in C, building no object a schema does not name: a
    map, a string where an int goes, or a field too many is a ProtocolError. A message may
    carry fewer fields than it declares (the rest take their defaults), so a field added at
    the end is read by older code as absent."""

    OP: ClassVar[Op]

    def __post_init__(self) -> None:
        hashes = getattr(self, "hashes", None)
        if hashes and len(hashes) % HASH_BYTES:
            raise ProtocolError(f"hashes field is {len(hashes)} bytes, not a multiple "
                                f"of {HASH_BYTES}")


class HashesMessage(Message):
    hashes: bytes

    @property
    def hash_list(self) -> list[bytes]:
        h = self.hashes
        if len(h) == HASH_BYTES:  # one block, the common request: no comprehension
            return [h]
        return [h[i:i + HASH_BYTES] for i in range(0, len(h), HASH_BYTES)]


def pack_hashes(hashes) -> bytes:
    try:  # bytes, and any other buffer, joined as they are: no generator, no copies
        out = b"".join(hashes)
    except TypeError:
        out = b"".join(map(hash_bytes, hashes))
    if len(out) != HASH_BYTES * len(hashes) or (
            len(hashes) > 1 and not all(map(HASH_BYTES.__eq__, map(len, hashes)))):
        # (each checked: a 15-byte and a 17-byte hash made two keys the caller never named)
        bad = next((i for i, h in enumerate(hashes) if len(h) != HASH_BYTES), 0)
        raise ValueError(f"block hashes are {HASH_BYTES} bytes each; hash {bad} of "
                         f"{len(hashes)} is {len(hashes[bad])}")
    return out


def hash_bytes(h) -> bytes:
    """One block hash as bytes: a bytes-like object of HASH_BYTES (a str or an int made
    "string argument without an encoding", "object of type 'int' has no len()" or, on the
    same-host path, bytes(5): five zero bytes)."""
    if isinstance(h, (str, int)) or not hasattr(h, "__len__"):
        raise TypeError(f"block hashes are {HASH_BYTES}-byte bytes objects (as hash_blocks "
                        f"makes them), not {type(h).__name__}")
    return bytes(h)


def _msg(op: Op, reply: bool = False):
    def wrap(cls):
        cls.OP = op
        cls.REPLY = reply
        return cls
    return wrap


@_msg(Op.HELLO)
class Hello(Message):
    token: str = ""
    model: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    block_tokens: int = 0
    revision: str = ""
    tenant: str = ""
    agent: bool = False       # send the arena's transfer-agent metadata and a capability
    agent_key: bytes = b""    # a capability this client already holds (kept, not reissued)
    codec: str = "raw"        # Namespace.codec: blocks of each codec are a namespace apart


@_msg(Op.HELLO, reply=True)
class HelloOk(Message):
    node_id: str = ""
    block_bytes: int = 0
    max_payload_bytes: int = 0
    instance: bytes = b""     # random per daemon process: the local socket reaches the same one
    local_socket: str = ""    # abstract Unix socket of same-host clients ("" = none)
    arena_id: bytes = b""     # the namespace's DRAM arena ("" = no DRAM tier); SHARE maps it
    shm_slots: int = 0
    agent_meta: bytes = b""   # transfer Agent metadata exporting the DRAM arena (if asked)
    agent_region: int = -1    # the arena's region id in that agent
    agent_key: bytes = b""    # the capability that agent wants from this client
    lease_ttl_s: float = 0.0  # how long a GET's lease holds its slots (0: not said, 30 s)


@_msg(Op.SHARE)
class Share(Message):
    """Same-host only (the local socket): hand me the namespace's DRAM arena (read-write:
    I write the slots RESERVE gives me) and its slot directory (read-only)."""


@_msg(Op.SHARE, reply=True)
class ShareOk(Message):
    arena_id: bytes = b""
    num_slots: int = 0        # two descriptors ride on this frame: arena, directory


@_msg(Op.PUTS)
class Puts(Message):
    """Same-host only: make this connection a put channel (kvstore.putring): the reply
    carries the ring's shared memory and an eventfd to ring after appending commits."""


@_msg(Op.PUTS, reply=True)
class PutsOk(Message):
    arena_id: bytes = b""     # the arena the granted slots are in
    capacity: int = 0         # commit records the ring holds
    grant_capacity: int = 0   # two descriptors ride on this frame: ring, doorbell


@_msg(Op.FLUSH)
class Flush(Message):
    """Commit every record of this connection's put channel before replying (Ack.value:
    how many were committed), so what this client put is visible to its next request;
    then grant the channel at least `want` slots when the daemon can (a batch bigger than
    the stock it keeps, put with this one request instead of a reserve and a commit)."""

    want: int = 0


@_msg(Op.PUT)
class Put(HashesMessage):
    hashes: bytes = b""
    staged: bool = False      # the blocks are in this connection's staging segment (STAGE),
    # rows 0..n-1, and the frame carries no payload: one request, no socket copy


@_msg(Op.STAGE)
class Stage(Message):
    """Same-host only: ask for (or regrow) this connection's staging segment, anonymous
    shared memory the daemon makes and hands over as a descriptor (it goes with the
    connection); the client fills it before a staged PUT."""

    nbytes: int = 0


@_msg(Op.STAGE, reply=True)
class StageOk(Message):
    nbytes: int = 0           # one descriptor rides on this frame


@_msg(Op.PUT, reply=True)
class PutOk(Message):
    statuses: bytes = b""     # one PutStatus code per block


@_msg(Op.GET)
class Get(HashesMessage):
    hashes: bytes = b""
    shm: bool = False         # the client can copy DRAM slots itself (arena or agent)
    release: tuple[int, ...] = ()  # leases the client is done with (saves a round trip)
    prefix: bool = False      # only the longest stored prefix (a miss ends the read)


@_msg(Op.GET, reply=True)
class GetOk(Message):
    tiers: bytes = b""        # TierKind per block, MISS when absent
    lease_id: int = 0         # nonzero: some `slots` are leased; RELEASE it once copied
    slots: bytes = b""        # (shm requests) int64 per block: its leased DRAM slot, or
    # NO_SLOT; the hits with NO_SLOT follow inline, in order. Without shm: every hit inline.


@_msg(Op.RESERVE)
class Reserve(HashesMessage):
    hashes: bytes = b""


@_msg(Op.RESERVE, reply=True)
class ReserveOk(Message):
    reservation_id: int = 0
    statuses: bytes = b""
    slots: bytes = b""        # int64 DRAM slot to write, NO_SLOT: send it inline on commit


@_msg(Op.COMMIT)
class Commit(Message):
    reservation_id: int = 0   # payload: the STORED blocks without a DRAM slot, in order


@_msg(Op.ABORT)
class Abort(Message):
    reservation_id: int = 0


@_msg(Op.EXISTS)
class Exists(HashesMessage):
    hashes: bytes = b""


@_msg(Op.MATCH)
class Match(HashesMessage):
    hashes: bytes = b""


@_msg(Op.MATCH, reply=True)
class MatchOk(Message):
    num_blocks: int = 0
    tiers: bytes = b""


@_msg(Op.REMOVE)
class Remove(HashesMessage):
    hashes: bytes = b""


@_msg(Op.PIN)
class Pin(HashesMessage):
    hashes: bytes = b""
    ttl_s: float | None = None


@_msg(Op.UNPIN)
class Unpin(HashesMessage):
    hashes: bytes = b""


@_msg(Op.RELEASE)
class Release(Message):
    lease_ids: tuple[int, ...] = ()


@_msg(Op.TOUCH)
class Touch(HashesMessage):
    """Blocks the client copied straight from published DRAM slots (no GET was sent): the
    daemon counts them as hits and marks them recently used. Ack.value: how many of the
    reads were of blocks it still holds."""

    hashes: bytes = b""
    reads: bytes = b""  # uint32 (little-endian) per block: how often it was read; empty: once


TOUCH_MAX_READS = 1 << 16  # reads one TOUCH may report of one block; more count as this many.
# A client reports at least every 50 ms while it reads (TouchLog), and a same-host read takes
# microseconds: only a client inflating its namespace's hit counters gets near it.


@_msg(Op.STATS)
class Stats(Message):
    """A store's figures (StatsOk)."""


@_msg(Op.STATS, reply=True)
class StatsOk(Message):
    misses: int = 0
    open_reservations: int = 0
    open_leases: int = 0
    tiers: tuple[tuple[int, ...], ...] = ()  # (kind, capacity, used, free, *TierCounters)
    write_errors: int = 0       # puts a tier could not store (answered NO_SPACE)
    background_errors: int = 0  # maintenance passes that failed


@_msg(Op.ERROR, reply=True)
class Error(Message):
    code: int = ErrorCode.INTERNAL
    message: str = ""


class Ack(Message):
    """The reply of the other ops: success plus a count (`value`) or per-block `flags`."""

    value: int = 0
    flags: bytes = b""


REQUESTS = {cls.OP: cls for cls in (Hello, Put, Get, Reserve, Commit, Abort, Exists, Match,
                                    Remove, Pin, Unpin, Release, Stats, Touch,
                                    Stage, Share, Puts, Flush)}
REPLIES = {cls.OP: cls for cls in (HelloOk, PutOk, GetOk, ReserveOk, MatchOk, StatsOk, Error,
                                   StageOk, ShareOk, PutsOk)}


def reply_class(op: Op) -> type[Message]:
    return REPLIES.get(op, Ack)


# ------------------------------------------------------------------------ codec


class Frame:
    __slots__ = ("op", "reply", "msg", "payload_bytes")

    def __init__(self, op: Op, reply: bool, msg: Message, payload_bytes: int) -> None:
        self.op, self.reply, self.msg, self.payload_bytes = op, reply, msg, payload_bytes


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[tuple[int, bool], msgspec.msgpack.Decoder] = {}  # by (op code, reply)
_OP_OF = {int(op): op for op in Op}


def encode(msg: Message, op: Op, reply: bool, payload_bytes: int = 0) -> bytes:
    """Prefix + header of one frame (the payload, if any, is sent after it). A request
    whose header passes MAX_HEADER_BYTES raises TOO_LARGE here, before a byte is sent (the
    daemon's refusal raced the request still going out: a broken pipe, then a retry sending
    it all again, reported as a lost connection)."""
    header = _ENCODER.encode(msg)
    if len(header) > MAX_HEADER_BYTES and not reply:
        raise RemoteError(ErrorCode.TOO_LARGE,
                          f"a {op.name} request of {len(header)} header bytes exceeds the "
                          f"{MAX_HEADER_BYTES}-byte limit: send fewer blocks per call "
                          f"(about {MAX_HEADER_BYTES // (HASH_BYTES + 2) // 1000}k hashes)")
    code = int(op) | (REPLY if reply else 0)
    head = PREFIX.pack(MAGIC, PROTOCOL_VERSION, code, len(header), payload_bytes) + header
    if payload_bytes:
        head += sockio.PAD[:header_pad(len(header), payload_bytes)]
    return head


def header_pad(header_len: int, payload_len: int) -> int:
    """The zero bytes between a frame's header and its payload (none without a payload):
    see transfer.sockio.PAYLOAD_ALIGN."""
    return sockio.payload_pad(PREFIX.size + header_len) if payload_len else 0


def decode_prefix(raw: bytes, max_payload: int,
                  max_header: int = MAX_HEADER_BYTES) -> tuple[int, bool, int, int]:
    """(op code, reply, header_len, payload_len) of a frame prefix, checked."""
    magic, version, code, header_len, payload_len = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}: not a kvtier data-plane client "
                            "(is this the HTTP port?)")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks "
                            f"{PROTOCOL_VERSION}); upgrade the older side", ErrorCode.VERSION)
    if header_len > max_header:
        raise ProtocolError(f"frame header of {header_len} bytes exceeds the "
                            f"{max_header}-byte limit" + (" (before HELLO)" if max_header
                                                         < MAX_HEADER_BYTES else ""),
                            ErrorCode.TOO_LARGE)
    if payload_len > max_payload:
        raise ProtocolError(f"frame payload of {payload_len} bytes exceeds the daemon's "
                            f"{max_payload}-byte limit (send fewer blocks per call)",
                            ErrorCode.TOO_LARGE)
    return code & ~REPLY, bool(code & REPLY), header_len, payload_len


def unpadded(header: bytes, header_len: int) -> bytes:
    """A header read with its pad (`header_pad`), without it. A pad that is not all zero
    bytes is a ProtocolError: its sender did not pad (an older protocol's framing, whose
    payload would otherwise be stored shifted by the pad's length)."""
    if len(header) == header_len:
        return header
    if not sockio.pad_is_zero(header, header_len):
        raise ProtocolError(f"the {len(header) - header_len} bytes between a frame's header "
                            f"and its payload must be zero (protocol {PROTOCOL_VERSION} starts "
                            f"a payload {sockio.PAYLOAD_ALIGN}-byte aligned in its frame)")
    return header[:header_len]


def op_of(op_code: int) -> Op:
    """The Op of a frame's code (a dict lookup: calling the enum costs ~1 us)."""
    op = _OP_OF.get(op_code)
    if op is None:
        raise ProtocolError(f"unknown op {op_code}")
    return op


def decode_header(op_code: int, reply: bool, header: bytes) -> Message:
    decoder = _DECODERS.get((op_code, reply))
    if decoder is None:
        op = op_of(op_code)
        cls = reply_class(op) if reply else REQUESTS.get(op)
        if cls is None:
            raise ProtocolError(f"op {op.name} is not a request")
        decoder = _DECODERS[op_code, reply] = msgspec.msgpack.Decoder(cls)
    try:
        return decoder.decode(header)
    except msgspec.DecodeError as e:  # includes ValidationError: a field of the wrong type
        cls = decoder.type
        raise ProtocolError(f"bad {op_of(op_code).name} header: {_named(cls, str(e))}") from e


def _named(cls: type, error: str) -> str:
    """msgspec's `$[i]` (array position) as the field's name."""
    m = re.search(r"\$\[(\d+)\]", error)
    if m and int(m.group(1)) < len(cls.__struct_fields__):
        return error.replace(m.group(0), f"{cls.__name__}.{cls.__struct_fields__[int(m.group(1))]}")
    return error


# ------------------------------------------------------------------------ blocking socket I/O


def timeval(seconds: float) -> bytes:
    """A struct timeval for SO_RCVTIMEO / SO_SNDTIMEO (0: no timeout at all)."""
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts on a blocking socket: MSG_WAITALL then fills a megabyte
    in one call (a socket with a Python timeout is non-blocking underneath: a poll and a
    recv per chunk that arrives), yet no peer holds a thread longer than `seconds` per call.
    A call that times out raises BlockingIOError (EAGAIN), not socket.timeout."""
    sock.settimeout(None)
    tv = timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


TIMED_OUT = (socket.timeout, BlockingIOError)  # what a timed-out call raises, either way


# As we read it, one MSG_WAITALL receive of a whole MiB-sized block keeps the socket to
# itself while it waits: segments arriving meanwhile queue in its backlog, unacknowledged,
# until the call ends, and the sender stalls on a full window; in 64 KiB calls the kernel
# takes them in between calls. Measured against one call a block, loopback, quiet 2-core
# host: a 4 MiB get 3.0 -> 3.6-3.9 GB/s, 16 x 1 MiB 2.8 -> 3.7-3.9, 16 x 4 MiB 2.2 -> 3.0;
# puts (the daemon receiving) 2.6 -> 3.1-3.4 (4 MiB), 2.2 -> 2.8-3.1 (16 x 1 MiB). 32 KiB
# measured the same, 16 KiB cost a 256 KiB get 10%, 512 KiB kept half the gain.
RECV_CHUNK = 64 << 10
DEADLINE_SLACK_S = 0.01  # how far one call may run past a send's or receive's deadline:
# within it, the socket's standing timeout is left as it is (no setsockopt per call where
# the deadline is the standing timeout from now, as a client's request has it)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None,
               standing: float | None = None) -> bool:
    """Fill `view` from the socket (recv_into straight into the destination, no copies),
    RECV_CHUNK bytes a call. MSG_WAITALL lets the kernel fill each chunk in one call on a
    blocking socket (the daemon's: +10-40% on megabyte payloads). A socket with a Python
    timeout is non-blocking underneath, so there the flag changes nothing and the timeout
    still holds. On a blocking socket the calls loop in C (transfer._stream.recv_into),
    which hands back whenever one comes back short. `deadline` (time.monotonic()):
    TimeoutError once past it with bytes still to come, checked before each call (the
    socket's timeout bounds each call: one that times out before the deadline is tried
    again). With `standing` (the socket's receive timeout), a call is also bounded by the
    time left, as send_views bounds its own; returns whether the socket's timeout was
    changed for it (the caller puts its own back)."""
    got, n, changed = 0, len(view), False
    bound = standing  # the receive timeout the socket has now
    fd = sockio.loop_fd(sock)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < 0:
                raise TimeoutError("the payload came too slowly")
            if bound is not None and left + DEADLINE_SLACK_S < bound:
                # (set again only once the last bound would overrun by the slack: a slow
                # payload took one setsockopt per chunk once its time left passed under
                # the standing timeout)
                bound, changed = left, _bound_call(sock, socket.SO_RCVTIMEO, left, 0.0)
        try:
            if fd >= 0:  # the same calls, looped in C with the GIL released once
                k = sockio.recv_loop(fd, view[got:] if got else view, RECV_CHUNK)
            else:
                k = sock.recv_into(view[got:], min(RECV_CHUNK, n - got), socket.MSG_WAITALL)
        except TIMED_OUT as e:
            if deadline is None:
                raise
            if time.monotonic() <= deadline:
                continue
            raise TimeoutError("the payload came too slowly") from e
        if k == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        got += k
    return changed


def _bound_call(sock: socket.socket, option: int, left: float, standing: float) -> bool:
    """Set the socket's `option` timeout (SO_SNDTIMEO, SO_RCVTIMEO) to the `left` seconds
    of a deadline where its `standing` timeout (0: none) would run more than DEADLINE_SLACK_S
    past it; whether it did."""
    if 0 < standing <= left + DEADLINE_SLACK_S:
        return False
    sock.setsockopt(socket.SOL_SOCKET, option, timeval(max(left, 1e-3)))
    return True


def recv_frame(sock: socket.socket, max_payload: int) -> Frame:
    """Read one frame's prefix and header; the caller reads `payload_bytes` after it."""
    raw = bytearray(PREFIX.size)
    recv_exact(sock, memoryview(raw))
    op_code, reply, header_len, payload_len = decode_prefix(bytes(raw), max_payload)
    header = bytearray(header_len + header_pad(header_len, payload_len))
    recv_exact(sock, memoryview(header))
    msg = decode_header(op_code, reply, unpadded(bytes(header), header_len))
    return Frame(_OP_OF[op_code], reply, msg, payload_len)


class FrameBuffer:
    """Bytes a connection received past what it has handed out (the start of a payload, or
    of the next frame), in one buffer kept for the connection's life and handed out by
    offset: receiving each chunk as a new bytes object, then joining and re-slicing it for
    every take, copied a 16 KiB chunk four or five times per reply. A buffer a big header
    grew goes back to CHUNK once drained. Shared by the blocking and asyncio readers
    (`FrameReader`, `kvstore.client.aconn`), which do the receiving."""

    CHUNK = 16 << 10

    def __init__(self) -> None:
        self._buf = bytearray(self.CHUNK)  # buffered bytes not handed out yet: [_at, _end)
        self._view = memoryview(self._buf)
        self._at = self._end = 0

    def pending(self) -> int:
        return self._end - self._at

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def room(self, n: int) -> memoryview:
        """Where to receive into, toward n bytes buffered (everything pending moved to the
        front first); then call `received`. A buffer too small for n grows only once full,
        doubling (to n at most): it holds about what has arrived. Grown to n at once, a
        peer that announced a 1 MiB header and sent one byte had the daemon hold 1 MiB per
        connection (300 such: +311 MiB, kept by the tuned heap after they closed)."""
        have = self._end - self._at
        if self._at + n > len(self._buf):
            if self._at:
                self._view[:have] = self._view[self._at:self._end]
                self._at, self._end = 0, have
            if have == len(self._buf):
                self._grow(min(n + self.CHUNK, 2 * len(self._buf)))
        return self._view[self._end:]

    def _grow(self, size: int) -> None:
        """A buffer of `size` bytes, the pending ones (at the front) moved into it."""
        buf = bytearray(size)
        buf[:self._end] = self._view[:self._end]
        self._view.release()
        self._buf, self._view = buf, memoryview(buf)

    def received(self, k: int) -> None:
        self._end += k

    def load(self, data: bytes) -> None:
        """Buffer bytes received elsewhere (with descriptors, or a connection's first frame
        read before its thread started); nothing may be pending."""
        self._at = self._end = 0
        if len(data) > len(self._buf):
            self._grow(len(data) + self.CHUNK)
        self._view[:len(data)] = data
        self._end = len(data)

    def take(self, n: int) -> bytes:
        """The next n bytes (pending: the caller received them first)."""
        at = self._at
        out = bytes(self._view[at:at + n])
        self._at = at + n
        if self._at == self._end:
            self._drained()
        return out

    def take_into(self, view: memoryview) -> int:
        """Copy pending bytes into the front of `view`; how many."""
        k = min(self._end - self._at, view.nbytes)
        if k:
            view[:k] = self._view[self._at:self._at + k]
            self._at += k
            if self._at == self._end:
                self._drained()
        return k

    def _drained(self) -> None:
        self._at = self._end = 0  # the next receive lands at the front
        if len(self._buf) > self.CHUNK:  # (a buffer a big header grew is not kept)
            self._view.release()
            self._buf = bytearray(self.CHUNK)
            self._view = memoryview(self._buf)


class FrameReader:
    """Frames off one socket, reading prefix and header with one recv in the common case
    (a recv each cost 20-40 us more per round trip, measured on loopback). Bytes read past
    the header (the start of a payload, or of the next frame) are kept (`FrameBuffer`) and
    handed out first, so every read of that socket must go through this reader.

    `max_header` starts at the pre-authentication limit and `deadline` (a time.monotonic()
    by which the first frames must have arrived whole: a socket timeout bounds each read
    alone, so a client sending a byte a second would never time out) applies until then;
    the daemon lifts both once a HELLO has passed (`authenticated`). From then on a frame
    read that times out is retried until `idle_periods` socket timeouts have passed in a
    row with no byte (see DaemonConfig.timeout_periods)."""

    CHUNK = FrameBuffer.CHUNK

    def __init__(self, sock: socket.socket, max_header: int = MAX_HEADER_BYTES,
                 deadline: float | None = None) -> None:
        self.sock = sock
        self.max_header = max_header
        self.deadline = deadline
        self.payload_deadline: float | None = None  # by when a payload must be in (recv_into)
        # a client's: by when the frame it waits for must be in (`_take`), and the receive
        # timeout its socket stands at, which each read is then bounded by the time left
        # within (see recv_exact); None: the socket's own timeout bounds each read alone
        self.reply_deadline: float | None = None
        self.standing: float | None = None
        self.rebound = False  # a read changed the socket's timeout: its owner puts it back
        self.buffered = FrameBuffer()
        self.idle_periods = 1
        self.spin: sockio.Spin | None = None  # poll before blocking for a frame (set by the owner)

    def authenticated(self, idle_periods: int = 1) -> None:
        self.max_header = MAX_HEADER_BYTES
        self.deadline = None
        self.idle_periods = idle_periods

    def _before_read(self) -> None:
        """Bound the next read by what is left of the deadline (TimeoutError once past)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the connection did not authenticate in time")
        kernel_timeouts(self.sock, max(left, 1e-3))  # (0 s would mean no timeout at all)

    def _take(self, n: int) -> bytes:
        buf, silent, spin = self.buffered, 0, self.spin
        bound = self.standing  # (as recv_exact's: set again only past the slack)
        while buf.pending() < n:
            polled = False
            if self.deadline is not None:
                self._before_read()
                spin = None
            elif self.reply_deadline is not None:
                left = self.reply_deadline - time.monotonic()
                if left < 0:
                    raise TimeoutError("the reply came too slowly")
                if bound is not None and left + DEADLINE_SLACK_S < bound:
                    bound = left
                    self.rebound = _bound_call(self.sock, socket.SO_RCVTIMEO, left, 0.0)
            if spin is not None:
                k = spin.poll(self.sock, buf.room(n))
                if k is not None:
                    if not k:
                        raise ConnectionError("peer closed the connection mid-frame")
                    buf.received(k)
                    continue
                polled = True
            try:
                k = self.sock.recv_into(buf.room(n))
                if polled:
                    spin.blocked()
            except TIMED_OUT:
                silent += 1
                if silent < self.idle_periods:
                    continue
                raise
            if not k:
                raise ConnectionError("peer closed the connection mid-frame")
            buf.received(k)
            silent = 0
        return buf.take(n)

    def frame(self, max_payload: int) -> Frame:
        """One frame's prefix and header; read its `payload_bytes` with `recv_into` next."""
        op_code, reply, header_len, payload_len = decode_prefix(
            self._take(PREFIX.size), max_payload, self.max_header)
        msg = decode_header(op_code, reply, unpadded(
            self._take(header_len + header_pad(header_len, payload_len)), header_len))
        return Frame(_OP_OF[op_code], reply, msg, payload_len)

    def frame_with_fds(self, max_payload: int) -> tuple[Frame, list[int]]:
        """A frame and the descriptors attached to its first byte (a Unix socket's reply to
        SHARE or STAGE). The caller owns (and must close) every descriptor returned."""
        if self.buffered.pending():
            raise ProtocolError("descriptors expected at a frame boundary, bytes were pending")
        data, fds, flags = recv_fds(self.sock, self.CHUNK, MAX_FDS)
        try:
            if not data:
                raise ConnectionError("peer closed the connection")
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("more descriptors than a reply may carry")
            self.buffered.load(data)
            return self.frame(max_payload), fds
        except BaseException:
            close_fds(fds)
            raise

    def recv_into(self, view: memoryview) -> None:
        """Fill `view` (payload bytes): buffered ones first, then straight from the socket
        with one MSG_WAITALL read (per block: a gathered recvmsg_into of several blocks
        measured slower on loopback, 0.80x vs 0.84x a raw socket for 16 x 1 MiB)."""
        k = self.buffered.take_into(view)
        if k < view.nbytes:
            try:
                if recv_exact(self.sock, view[k:], self.payload_deadline, self.standing):
                    self.rebound = True
            except BaseException:  # (it may have changed the timeout before it failed)
                self.rebound = self.rebound or self.standing is not None
                raise


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int], int]:
    """socket.recv_fds, the descriptors close-on-exec from the start (MSG_CMSG_CLOEXEC,
    which socket.recv_fds of Python 3.11 takes but never passes on): a program the client
    process runs must not inherit the namespace's slot directory or a doorbell. (data,
    descriptors, flags)"""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(bufsize, socket.CMSG_LEN(maxfds * fds.itemsize),
                                           socket.MSG_CMSG_CLOEXEC)
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[:len(cdata) - (len(cdata) % fds.itemsize)])
    return data, list(fds), flags


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def send_frame_fds(sock: socket.socket, msg: Message, op: Op, fds: list[int]) -> None:
    """A reply frame with no payload and `fds` attached to its first byte (Unix sockets)."""
    data = encode(msg, op, True)
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def send_frame(sock: socket.socket, msg: Message, op: Op, reply: bool, payload=(),
               deadline: float | None = None, standing: float = 0.0) -> bool:
    """One frame with its payload buffers, gathered by sendmsg (no join of the payload).
    `deadline` and `standing`: as send_views, whose answer this returns."""
    if not payload:
        data = encode(msg, op, reply)
        if deadline is None:
            sock.sendall(data)
            return False
        if 0 < standing <= deadline - time.monotonic() + DEADLINE_SLACK_S:
            sent = sock.send(data)  # one call takes a frame as a rule (the standing timeout
            if sent == len(data):  # bounds it within the deadline): no views, no loop
                return False
            data = memoryview(data)[sent:]
        return send_views(sock, [memoryview(data)], deadline, standing)
    views = [memoryview(b).cast("B") for b in payload]
    head = memoryview(encode(msg, op, reply, sum(v.nbytes for v in views)))
    return send_views(sock, [head, *views], deadline, standing)


def send_views(sock: socket.socket, bufs: list[memoryview], deadline: float | None = None,
               standing: float = 0.0) -> bool:
    """Send flat byte views in order, gathered by sendmsg (256 at a time), whole.
    `deadline` (time.monotonic(); a blocking socket with kernel timeouts): TimeoutError
    once past it with bytes still to go. Each call is bounded by the time left and the
    deadline checked between calls: a peer that reads a little now and then, each call
    making some progress, is bounded by it all the same. The socket's send timeout is
    set to the time left where `standing` (the timeout it has: 0, none) would run more
    than DEADLINE_SLACK_S past the deadline; returns whether it was (the caller puts its own
    back)."""
    at, changed = 0, False
    while at < len(bufs):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer took its data too slowly")
            if _bound_call(sock, socket.SO_SNDTIMEO, left, standing):
                standing, changed = left, True  # (set again only past the slack)
        try:
            sent = sock.sendmsg(bufs[at:at + 256])
        except TIMED_OUT as e:
            if deadline is None:
                raise
            if time.monotonic() <= deadline:
                continue
            raise TimeoutError("the peer took its data too slowly") from e
        while at < len(bufs) and sent >= len(bufs[at]):
            sent -= len(bufs[at])
            at += 1
        if sent:
            bufs[at] = bufs[at][sent:]
    return changed
