"""Store counters (mutable, under the store lock) and the snapshot `stats()` returns."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple, Sequence

from kvstore.events import TierKind


@dataclass
class TierCounters:
    hits: int = 0
    bytes_in: int = 0         # bytes written into this tier (puts, demotions, promotions)
    bytes_out: int = 0        # bytes read out to callers
    demotions_in: int = 0     # blocks that arrived from the tier above
    demotions_out: int = 0    # blocks this tier pushed down
    promotions_in: int = 0    # blocks moved up into this tier on a hit
    evictions: int = 0        # blocks dropped from the store out of this tier
    corrupt: int = 0          # blocks that failed their checksum (dropped, served as misses)


class TierStats(NamedTuple):
    kind: TierKind
    capacity_blocks: int
    used_blocks: int
    free_blocks: int
    counters: TierCounters


class StoreStats(NamedTuple):
    model: str
    block_bytes: int
    tiers: tuple[TierStats, ...]
    misses: int
    open_reservations: int
    open_leases: int
    write_errors: int = 0       # puts a tier could not store (answered NO_SPACE)
    background_errors: int = 0  # background maintenance passes that failed (and went on)

    @classmethod
    def collect(cls, ns, tiers: Sequence, counters: Sequence[TierCounters], misses: int,
                reservations: int, leases: int, write_errors: int = 0,
                background_errors: int = 0) -> "StoreStats":
        rows = tuple(
            TierStats(t.kind, t.num_slots, t.num_used(), t.num_free(),
                      TierCounters(**{f.name: getattr(c, f.name) for f in fields(c)}))
            for t, c in zip(tiers, counters))
        return cls(ns.model, ns.block_bytes, rows, misses, reservations, leases, write_errors,
                   background_errors)

    def tier(self, kind: TierKind) -> TierStats:
        return next(t for t in self.tiers if t.kind is kind)

    @property
    def hits(self) -> int:
        return sum(t.counters.hits for t in self.tiers)
