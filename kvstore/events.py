"""KV events: what a node reports when blocks enter or leave one of its tiers.

The store emits them; the cluster index (`kvstore.index`) consumes them. Each node numbers
its events with a gap-free sequence so a consumer can detect loss and ask for a resync.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class TierKind(enum.IntEnum):
    """Storage tiers, fastest first. The integer order is the demotion order."""

    GPU = 0
    DRAM = 1
    SSD = 2


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class KVEvent:
    """Blocks `block_hashes` were stored in / removed from `tier` on `node_id`.

    `seq` is the node's event counter: consecutive events of one node have consecutive seqs.
    """

    kind: EventKind
    node_id: str
    seq: int
    tier: TierKind
    block_hashes: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError(f"KVEvent.seq must be >= 0, got {self.seq}")
        if not self.node_id:
            raise ValueError("KVEvent.node_id must be a non-empty string")
