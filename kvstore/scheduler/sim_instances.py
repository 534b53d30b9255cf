"""Simulated instances: an LRU block cache that reports KV events to the cluster index,
a FIFO prefill instance, and a continuously batching decode instance."""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

from kvstore.events import EventKind, KVEvent, TierKind
from kvstore.index import ClusterIndex
from kvstore.scheduler.cost_model import DecodeCost


class BlockCache:
    """LRU over blocks; each block carries the time its KV is (or will be) ready.

    Every change is published to `index` as a KV event, exactly as a live node would, so
    policies in the simulator read the same index they read live."""

    def __init__(self, node_id: str, capacity_blocks: int, index: ClusterIndex,
                 tier: TierKind = TierKind.DRAM) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        self.node_id, self.capacity_blocks, self.tier = node_id, capacity_blocks, tier
        self._index = index
        self._seq = 0
        self._ready: OrderedDict[Hashable, float] = OrderedDict()
        index.add_node(node_id)

    def __len__(self) -> int:
        return len(self._ready)

    def prefix(self, hashes: Sequence[Hashable], start: int = 0) -> int:
        """How many of `hashes[start:]`, from the start, are cached."""
        n = start
        while n < len(hashes) and hashes[n] in self._ready:
            n += 1
        return n - start

    def ready_s(self, hashes: Sequence[Hashable]) -> float:
        """When the last of `hashes` (all cached) is ready; 0 for none."""
        return max((self._ready[h] for h in hashes), default=0.0)

    def touch(self, hashes: Sequence[Hashable]) -> None:
        # Reverse order: a chain's head ends most recent, so its tail is evicted first.
        for h in reversed(hashes):
            self._ready.move_to_end(h)

    def insert(self, hashes: Sequence[Hashable], ready_s: float) -> None:
        """Cache `hashes` (ready at `ready_s`), evicting least recently used blocks."""
        new = [h for h in hashes if h not in self._ready]
        for h in reversed(hashes):
            if h in self._ready:
                self._ready.move_to_end(h)
            else:
                self._ready[h] = ready_s
        evicted = []
        while len(self._ready) > self.capacity_blocks:
            evicted.append(self._ready.popitem(last=False)[0])
        new_set = set(new)
        gone = set(evicted)
        self._publish(EventKind.STORED, [h for h in new if h not in gone])
        self._publish(EventKind.REMOVED, [h for h in evicted if h not in new_set])

    def _publish(self, kind: EventKind, hashes: list) -> None:
        if hashes:
            self._index.apply(KVEvent(kind, self.node_id, self._seq, self.tier, tuple(hashes)))
            self._seq += 1


class PrefillInstance:
    """Runs prefills one at a time in arrival order; `busy_until_s` ends its queue."""

    def __init__(self, node_id: str, cache: BlockCache) -> None:
        self.node_id, self.cache = node_id, cache
        self.busy_until_s = 0.0

    def queue_s(self, now_s: float) -> float:
        return max(0.0, self.busy_until_s - now_s)


class DecodeInstance:
    """Continuous batching. Every running sequence gains one token per step; a step takes
    `cost.step_s(batch, kv)`. A virtual clock counts steps, so a sequence finishes when the
    clock passes its start plus its token count, whatever the batch did meanwhile."""

    def __init__(self, node_id: str, capacity_tokens: int, cost: DecodeCost) -> None:
        self.node_id, self.capacity_tokens, self._cost = node_id, capacity_tokens, cost
        self.version = 0  # bumped when the next finish time may have changed
        self.assigned = 0  # sequences placed here and not finished (incl. still in prefill)
        self.assigned_tokens = 0
        self._steps, self._last_s = 0.0, 0.0
        self._finish: list[tuple[float, int, int]] = []  # (step count, request id, tokens)
        self._running_tokens = 0
        self._waiting: deque[tuple[int, int, int]] = deque()  # (request id, kv, steps)

    def step_s(self) -> float:
        return self._cost.step_s(len(self._finish), self._running_tokens)

    def _advance(self, now_s: float) -> None:
        if self._finish:
            self._steps += (now_s - self._last_s) / self.step_s()
        self._last_s = now_s

    def arrive(self, request_id: int, kv_tokens: int, steps: int, now_s: float) -> None:
        """A prefilled sequence arrives; it runs now if its KV fits, else waits (FIFO)."""
        self._advance(now_s)
        self._waiting.append((request_id, kv_tokens, steps))
        self._admit()

    def _admit(self) -> None:
        while self._waiting:
            rid, kv, steps = self._waiting[0]
            if self._finish and self._running_tokens + kv > self.capacity_tokens:
                return
            self._waiting.popleft()
            heapq.heappush(self._finish, (self._steps + steps, rid, kv))
            self._running_tokens += kv
        self.version += 1

    def next_finish_s(self) -> float | None:
        if not self._finish:
            return None
        return self._last_s + max(0.0, self._finish[0][0] - self._steps) * self.step_s()

    def pop_finished(self, now_s: float) -> list[int]:
        """Sequences done by `now_s`; frees their KV and admits waiting ones."""
        self._advance(now_s)
        done = []
        while self._finish and self._finish[0][0] <= self._steps + 1e-9:
            _, rid, kv = heapq.heappop(self._finish)
            self._running_tokens -= kv
            done.append(rid)
        self._admit()
        return done
