"""The half of each SDK op that does no I/O, shared by `Client` (blocking) and `AsyncClient`
(asyncio): checking a reply frame, reading what it says, and the copies between caller
buffers and the daemon's shared memory. The two clients differ only in how they wait."""
from __future__ import annotations

import itertools
import math
import time
from typing import Any, NamedTuple, Sequence

import numpy as np

from kvstore import wire as w
from kvstore.buffers import cpu_array
from kvstore.client.errors import ConnectError, RequestTimeout
from kvstore.events import TierKind
from kvstore.keys import Namespace
from kvstore.stats import StoreStats, TierCounters, TierStats
from kvstore.api import MatchResult, PutStatus
from transfer.copy import copy_bytes

PUT_STATUSES = (PutStatus.STORED, PutStatus.EXISTS, PutStatus.NO_SPACE)
# Off the daemon's host a put moving bytes by transfer agent costs three requests; up to
# this many bytes one request carrying them inline is faster.
INLINE_PUT_BYTES = 512 << 10
# Off its host a get of up to this many bytes comes inline in GET's reply (one request)
# rather than leased and read by the transfer agent (two requests, the second the agent's):
# where the agent's backend is RDMA (nixl, ucx). Over its tcp backend every get comes
# inline: the agent's read is one more stream of the same bytes over loopback-class TCP,
# and lost at every size measured (bench/store_service.py, p50: 256 KiB 427 vs 134 us,
# 1 MiB 681 vs 336, 4 MiB 1160 vs 787; 16 x 1 MiB 4.5 vs 5.3 GB/s).
INLINE_GET_BYTES = 512 << 10
# On the daemon's host a put of up to this many bytes is copied into the connection's
# staging segment and stored with one request (the daemon copies it into its slots);
# bigger ones reserve slots, are copied there directly and committed (two requests, one
# copy), which wins once a copy costs more than a round trip.
STAGED_PUT_BYTES = 2 << 20
MAX_STAGE_BYTES = 64 << 20  # the daemon's limit for one connection's staging segment
# A connection polls this long for a reply before it sleeps (transfer.sockio.Spin; the
# daemon's --spin-us polls for requests likewise)
SPIN_US = 100.0
# Direct (no-request) reads are reported to the daemon in TOUCH requests: one at most
# every TOUCH_EVERY_S, or sooner once TOUCH_BATCH distinct blocks wait. A TOUCH every 256
# reads (the first rule) cost a same-host 1 MiB read loop 1-6 us a read on average: each
# round trip, ~0.3-0.8 ms, slowed the reads around it on a 2-core host.
TOUCH_EVERY_S = 0.05
TOUCH_BATCH = 4096
RETRYABLE = (ConnectionError, OSError, w.ProtocolError)  # a dead or confused connection


class TouchLog:
    """Direct reads not yet reported: each distinct block once, with how many times it was
    read (a TOUCH carries the counts, so hit figures stay exact while a block read again
    and again costs the daemon one lookup per TOUCH, not one per read). Not thread-safe:
    the blocking client holds its lock around it."""

    def __init__(self) -> None:
        self.reads: dict[bytes, int] = {}
        self.sent_at = time.monotonic()

    def add(self, hashes: Sequence[bytes]) -> bool:
        """Log reads of `hashes`; True when a TOUCH is due."""
        reads = self.reads
        for h in hashes:
            reads[h] = reads.get(h, 0) + 1
        return self._due()

    def _due(self) -> bool:
        return len(self.reads) >= TOUCH_BATCH or time.monotonic() - self.sent_at >= TOUCH_EVERY_S

    def take(self, everything: bool = False) -> w.Touch | None:
        """The TOUCH due now (with `everything`: one even if none is due), if any: at most
        TOUCH_BATCH blocks (a frame's header stays small), which leave the log."""
        reads = self.reads
        if not reads or not (everything or self._due()):
            return None
        if len(reads) <= TOUCH_BATCH:
            batch, self.reads = reads, {}
        else:  # a huge read: the rest goes in the next TOUCH (due at once)
            batch = {h: reads.pop(h) for h in list(itertools.islice(reads, TOUCH_BATCH))}
        self.sent_at = time.monotonic()
        return w.Touch(hashes=b"".join(batch), reads=np.fromiter(
            (min(n, w.TOUCH_MAX_READS) for n in batch.values()), "<u4", len(batch)).tobytes())


def check_timeouts(timeout_s: float, connect_timeout_s: float) -> None:
    """A client's timeouts are finite seconds (an infinite one raised a bare OverflowError
    from the socket layer at the first connection)."""
    for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ValueError(f"{name} is a finite number of seconds, not {value!r}")


def reusable_after(e: BaseException) -> bool:
    """Whether a connection whose call raised `e` is still in step with the daemon: a
    refusal the daemon answered, or a bad argument caught before sending, leaves its frames
    in order; a failure mid-frame or a cancelled call may not."""
    if isinstance(e, w.RemoteError):
        return e.code is not w.ErrorCode.UNAVAILABLE
    return isinstance(e, (ValueError, TypeError))


def raise_unless_retryable(e: Exception, attempt: int, where) -> None:
    """After a call on a pooled connection failed with `e`: return to retry it once on a
    fresh connection (the daemon restarted, or was draining that namespace), else raise
    what the caller should see. A timeout is never retried: the daemon may still be doing it."""
    if isinstance(e, RequestTimeout):
        raise e
    if isinstance(e, RETRYABLE):
        if isinstance(e, ConnectError) or attempt:
            raise ConnectError(f"lost the connection to {where}: {e}") from e
        return
    if isinstance(e, w.RemoteError) and e.code is w.ErrorCode.UNAVAILABLE and not attempt:
        return
    raise e


def check_reply(frame: w.Frame, op: w.Op) -> tuple[w.Message, int]:
    """The reply to `op` and its payload length; an ERROR frame raises its RemoteError."""
    if not frame.reply:
        raise w.ProtocolError(f"the daemon sent a request frame ({frame.op.name})")
    if frame.op is w.Op.ERROR:
        msg = frame.msg
        raise w.remote_error(w.ErrorCode(msg.code) if msg.code in w.ErrorCode._value2member_map_
                             else w.ErrorCode.INTERNAL, msg.message)
    if frame.op is not op:
        raise w.ProtocolError(f"expected a {op.name} reply, got {frame.op.name}")
    return frame.msg, frame.payload_bytes


def check_fds(frame: w.Frame, op: w.Op, fds: list[int], num_fds: int) -> w.Message:
    """A reply that must carry `num_fds` descriptors; closes them all when it raises."""
    try:
        reply, _ = check_reply(frame, op)
        if len(fds) != num_fds:
            raise w.ProtocolError(f"{op.name} reply carried {len(fds)} descriptors, "
                                  f"not {num_fds}")
    except BaseException:
        w.close_fds(fds)
        raise
    return reply


_TIER_OF = {int(t): t for t in TierKind}


def tiers_of(raw: bytes) -> list[TierKind | None]:
    """Per block, the tier a reply names (None: a miss; an unknown code is refused)."""
    try:
        return [None if b == w.MISS else _TIER_OF[b] for b in raw]
    except KeyError as e:
        raise w.ProtocolError(f"a reply names unknown tier {e.args[0]}") from None


def put_statuses(statuses) -> list[PutStatus]:
    return [PUT_STATUSES[s] for s in statuses]


def hello(ns: Namespace, token: str, want_agent: bool = False,
          agent_key: bytes = b"") -> w.Hello:
    return w.Hello(token=token, model=ns.model, num_layers=ns.num_layers,
                   num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim, dtype=ns.dtype,
                   block_tokens=ns.block_tokens, revision=ns.revision, tenant=ns.tenant,
                   agent=want_agent, agent_key=agent_key, codec=ns.codec)


class GetLayout(NamedTuple):
    """Where a GET reply's hits are: `inline` (indices whose bytes follow the reply, in
    order) and `leased` (indices to copy from `slots`, leased until released)."""
    tiers: list[TierKind | None]
    inline: list[int]
    leased: list[int]
    slots: np.ndarray | None


def get_layout(reply: w.GetOk, payload_bytes: int, block_bytes: int) -> GetLayout:
    tiers = tiers_of(reply.tiers)
    hits = [i for i, t in enumerate(tiers) if t is not None]
    slots = np.frombuffer(reply.slots, "<i8") if reply.slots else None
    if slots is not None and len(slots) != len(tiers):
        raise w.ProtocolError(f"GET reply names {len(slots)} slots for {len(tiers)} blocks")
    leased = [] if slots is None else [i for i in hits if slots[i] != w.NO_SLOT]
    inline = [i for i in hits if slots is None or slots[i] == w.NO_SLOT]
    if payload_bytes != len(inline) * block_bytes:
        raise w.ProtocolError(f"GET reply carries {payload_bytes} bytes for "
                              f"{len(inline)} inline hits")
    return GetLayout(tiers, inline, leased, slots)


DEFAULT_LEASE_TTL_S = 30.0  # what a daemon that does not say its lease TTL holds to
LEASE_MARGIN = 0.9  # of the TTL: what a copy may take, the rest for clocks and the reply


def drop_late_copies(tiers: list, leased: Sequence[int], sent_at: float,
                     info: w.HelloOk) -> None:
    """Leased blocks copied after their lease may have ended are misses: the daemon reuses
    a lease's slots once its TTL passes, so a copy that finished later (a client stalled
    by a pause, SIGSTOP, a busy host) may hold another block's bytes, and had been handed
    over as a hit. The lease began after `sent_at` (the GET's send, on this monotonic
    clock), so a copy done within LEASE_MARGIN of the TTL from then read leased slots."""
    if not leased:
        return
    ttl = info.lease_ttl_s if info.lease_ttl_s > 0 else DEFAULT_LEASE_TTL_S
    if time.monotonic() - sent_at >= LEASE_MARGIN * ttl:
        for i in leased:
            tiers[i] = None


def match_of(reply: w.MatchOk) -> MatchResult:
    return MatchResult(reply.num_blocks, tuple(tiers_of(reply.tiers)))


def flags_of(reply) -> list[bool]:
    return [bool(b) for b in reply.flags]


def stats_of(reply: w.StatsOk, ns: Namespace) -> StoreStats:
    tiers = tuple(TierStats(TierKind(row[0]), row[1], row[2], row[3], TierCounters(*row[4:]))
                  for row in reply.tiers)
    return StoreStats(ns.model, ns.block_bytes, tiers, reply.misses, reply.open_reservations,
                      reply.open_leases, reply.write_errors, reply.background_errors)


def iter_rows(rows):
    return rows if isinstance(rows, list) else list(rows)


def payload_views(rows) -> list:
    """A put's rows as a frame's payload buffers: host rows held back to back (a `[n,
    bytes]` array or CPU tensor) as one buffer, else one per row."""
    whole = cpu_array(rows)
    return [whole] if whole is not None else [as_numpy(r) for r in iter_rows(rows)]


def as_numpy(row) -> np.ndarray:
    if isinstance(row, np.ndarray):
        return row
    return row.numpy() if row.device.type == "cpu" else row.cpu().numpy()


def stage(staging: np.ndarray, rows, n: int, block_bytes: int) -> None:
    """Copy n blocks into the front of a staging segment."""
    staged = staging[:n * block_bytes].reshape(n, block_bytes)
    whole = cpu_array(rows)
    if whole is not None:
        np.copyto(staged, whole.reshape(n, block_bytes), casting="no")
        return
    for i, row in enumerate(iter_rows(rows)):
        np.copyto(staged[i], as_numpy(row))


copy_row = copy_bytes  # one block between the arena and a caller buffer


def row_view(rows, host, i: int) -> tuple[memoryview, Any]:
    """`host_view` of rows[i], or its part of `host` (`host_rows` of all the rows, made
    once): a GET over TCP received row by row converted each (~3 us and more a row)."""
    return (memoryview(host[i]), None) if host is not None else host_view(rows[i])


def host_view(row) -> tuple[memoryview, Any]:
    """Where to receive a row's bytes: the row itself (host memory), or a host staging
    array to copy to the device row afterwards (returned second)."""
    if isinstance(row, np.ndarray):
        return memoryview(row), None
    if row.device.type == "cpu":
        return memoryview(row.numpy()), None
    staging = np.empty(row.numel(), np.uint8)
    return memoryview(staging), staging
