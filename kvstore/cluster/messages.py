"""Messages between nodes and the leader's metadata service (msgpack bodies over HTTP).

Block hashes travel packed: one bytes value of 16 * n bytes. Every message carries a
version; an unknown version or a malformed body is a ClusterError the receiver turns into
HTTP 400.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack

from kvstore.cluster.records import ClusterError
from kvstore.events import EventKind, KVEvent, TierKind
from kvstore.keys import HASH_BYTES

VERSION = 1
_KINDS = {EventKind.STORED: 0, EventKind.REMOVED: 1}
_KIND_OF = {v: k for k, v in _KINDS.items()}


def pack_hashes(hashes) -> bytes:
    return b"".join(bytes(h) for h in hashes)


def unpack_hashes(raw: bytes) -> list[bytes]:
    if len(raw) % HASH_BYTES:
        raise ClusterError(f"packed hashes are {len(raw)} bytes, not a multiple of {HASH_BYTES}")
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


def _load(raw: bytes, name: str, fields: int) -> list:
    try:
        body = msgpack.unpackb(raw, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ClusterError(f"malformed {name} message: {e}") from e
    if not isinstance(body, list) or len(body) != fields or body[0] != VERSION:
        raise ClusterError(f"{name} message of an unknown version or shape")
    return body


@dataclass(frozen=True)
class EventBatch:
    """KV events of one namespace store of one node, in seq order."""

    node_id: str
    ns_id: int
    events: tuple[KVEvent, ...]

    def encode(self) -> bytes:
        rows = [[_KINDS[e.kind], e.seq, int(e.tier), pack_hashes(e.block_hashes)] for e in self.events]
        return msgpack.packb([VERSION, self.node_id, self.ns_id, rows], use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> "EventBatch":
        _, node_id, ns_id, rows = _load(raw, "events", 4)
        try:
            events = tuple(KVEvent(_KIND_OF[k], node_id, seq, TierKind(t), tuple(unpack_hashes(h)))
                           for k, seq, t, h in rows)
        except (KeyError, ValueError, TypeError) as e:
            raise ClusterError(f"malformed event in batch from {node_id!r}: {e}") from e
        return cls(node_id, ns_id, events)


@dataclass(frozen=True)
class Snapshot:
    """A node's whole content for one namespace, as of its event `seq`."""

    node_id: str
    ns_id: int
    seq: int
    blocks: dict

    def encode(self) -> bytes:
        tiers = [[int(t), pack_hashes(hs)] for t, hs in self.blocks.items()]
        return msgpack.packb([VERSION, self.node_id, self.ns_id, self.seq, tiers], use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> "Snapshot":
        _, node_id, ns_id, seq, tiers = _load(raw, "snapshot", 5)
        try:
            blocks = {TierKind(int(t)): unpack_hashes(h) for t, h in tiers}
        except (ValueError, TypeError, AttributeError) as e:
            raise ClusterError(f"malformed snapshot from {node_id!r}: {e}") from e
        return cls(node_id, ns_id, seq, blocks)


@dataclass(frozen=True)
class Locate:
    """Which nodes hold each of `hashes` (namespace `ns_id`), and the longest prefix per node."""

    ns_id: int
    hashes: tuple[bytes, ...]

    def encode(self) -> bytes:
        return msgpack.packb([VERSION, self.ns_id, pack_hashes(self.hashes)], use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> "Locate":
        _, ns_id, packed = _load(raw, "locate", 3)
        return cls(ns_id, tuple(unpack_hashes(packed)))


@dataclass(frozen=True)
class Located:
    holders: tuple[tuple[str, ...], ...]   # per hash, the nodes holding it
    prefix: tuple[tuple[str, int], ...]    # (node, leading blocks it holds), longest first

    def encode(self) -> bytes:
        return msgpack.packb([VERSION, [list(h) for h in self.holders],
                              [list(p) for p in self.prefix]], use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> "Located":
        _, holders, prefix = _load(raw, "located", 3)
        return cls(tuple(tuple(h) for h in holders), tuple((n, int(k)) for n, k in prefix))
