"""KV events for the router's block index: what a worker's paged cache and the pool hold.

Producers number their events gap-free per node, like `TieredStore`, so the router's
`ClusterIndex` applies them in order, holds early ones and asks for a snapshot on a gap:
- `CacheEventLog` (in a worker): the engine's prefix cache (`BlockPool.cached`: hash ->
  block) changes on the engine thread only: a block is registered when its KV is complete
  and its hash dropped when the block is reallocated (evicted). `update()`, called on that
  thread after every step, compares the cache with what it last reported and numbers the
  difference (tier GPU: the worker's own KV memory).
- the pool's `kvtier serve` answers `GET /kv/events` from its store's events.
Both keep recent events in an `EventRing` (kvstore.events), so a reader asks for
"everything after seq N" and gets them, or a snapshot when they are gone.

Wire format: `kvstore.cluster.messages.EventBatch` / `Snapshot` (what store nodes send
their cluster leader), with the kind in the `EVENTS_KIND_HEADER` header of the reply.
"""
from __future__ import annotations

import threading

from kvstore.cluster.messages import EventBatch, Snapshot
from kvstore.events import EventKind, EventRing, KVEvent, TierKind

class CacheEventLog:
    def __init__(self, node_id: str, ns_id: int, cached: dict) -> None:
        """`cached`: the engine's live hash -> block map (read on the engine thread only)."""
        self.node_id, self.ns_id, self._cached = node_id, ns_id, cached
        self._reported: frozenset[bytes] = frozenset()
        self._ring = EventRing()
        self._lock = threading.Lock()

    def update(self) -> None:
        """Engine thread: turn cache changes since the last call into events."""
        if len(self._cached) == len(self._reported) and self._cached.keys() == self._reported:
            return
        now = frozenset(self._cached)
        gone, new = self._reported - now, now - self._reported
        with self._lock:  # the base and its events change together for snapshot readers
            self._reported = now
            for kind, hashes in ((EventKind.REMOVED, gone), (EventKind.STORED, new)):
                if hashes:
                    self._ring.extend([KVEvent(kind, self.node_id, self._ring.next_seq,
                                               TierKind.GPU, tuple(sorted(hashes)))])

    def read(self, after: int | None) -> tuple[str, bytes]:
        """("events", EventBatch) of the events after seq `after`, or ("snapshot",
        Snapshot) when `after` is None or some of those events are gone."""
        with self._lock:
            events = None if after is None else self._ring.after(after)
            if events is None:
                return "snapshot", Snapshot(self.node_id, self.ns_id, self._ring.next_seq - 1,
                                            {TierKind.GPU: sorted(self._reported)}).encode()
        return "events", EventBatch(self.node_id, self.ns_id, events).encode()
