"""KV events: what a node reports when blocks enter or leave one of its tiers.

The store emits them; the cluster index (`kvstore.index`) consumes them. Each node numbers
its events with a gap-free sequence so a consumer can detect loss and ask for a resync.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Iterable

MAX_BUFFERED = 4096   # events an EventRing keeps for a slow reader; past that, a snapshot


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


class EventRing:
    """The last events of one node, in seq order, for readers that each ask for
    "everything after seq N" (and take a snapshot when the answer is None). Not thread-safe
    on its own."""

    def __init__(self, next_seq: int = 0) -> None:
        self.events: deque[KVEvent] = deque(maxlen=MAX_BUFFERED)
        self.next_seq = next_seq

    def extend(self, events: Iterable[KVEvent]) -> None:
        for e in events:
            if e.seq != self.next_seq:   # the producer lost some: only a snapshot helps now
                self.events.clear()
            self.events.append(e)
            self.next_seq = e.seq + 1

    def after(self, seq: int) -> tuple[KVEvent, ...] | None:
        """Events numbered after `seq`; None when some of them are no longer here, or when
        `seq` is past the last event (a cursor from before the producer restarted: the
        events it would skip are new ones)."""
        first = self.events[0].seq if self.events else self.next_seq
        if seq + 1 < first or seq + 1 > self.next_seq:
            return None
        return tuple(e for e in self.events if e.seq > seq)

    def reset(self, next_seq: int) -> None:
        """After a snapshot as of `next_seq - 1`: older events describe the past."""
        self.events.clear()
        self.next_seq = next_seq
