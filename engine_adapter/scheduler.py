"""Continuous batching: which requests run this step and how many tokens each computes.

Each step every running request gets its next tokens (one for a decode, a chunk for a
prefill), then waiting requests are admitted while the token budget, the sequence limit and
free blocks allow. Admission finds the longest cached prefix: first in the engine's own
paged cache, then in the store (loaded into fresh blocks; with a store that reads a prefix
and its bytes at once, in one round trip: `_admit_reading`).

Why every path ends (no input can hang the loop):
- A request never needs more blocks than the cache has: the engine refuses one whose
  prompt + max_tokens cannot fit (`OversizePolicy.REFUSE`), or, under `TRUNCATE`, a request
  that has filled the whole cache is finished with `length` here (`exhausted`).
- When a running request needs a block and none is free, the newest running request gives
  its blocks back (preempted, recomputed later, mostly from the prefix cache). That is
  another request whenever a newer one runs; the growing request steps back only for
  older ones, never when it runs alone (then every block not free is its own, and it fits).
  The oldest running request is never preempted, so it always progresses: two requests
  can never take turns evicting each other.
- A waiting request whose blocks are not free does not block the queue: later ones may be
  admitted ahead of it, but at most `max_admission_skips` of them. Then admission waits for
  it; the running requests finish (the oldest always progresses) and free the blocks it
  needs, which always suffice because it fits the empty cache.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine_adapter.block_pool import BlockPool
from engine_adapter.config import EngineConfig
from engine_adapter.connector import StoreConnector
from engine_adapter.request import FinishReason, Request, RequestStatus


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, connector: StoreConnector | None) -> None:
        self.config, self.pool, self.connector = config, pool, connector
        self.bt = config.block_tokens
        # tokens one request computes per step at most: a long prefill leaves the rest of
        # the step's budget to decodes and short prefills instead of stalling them
        self.chunk = config.max_prefill_chunk_tokens or config.max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.exhausted: list[Request] = []   # finished here (filled the cache), not yet reported

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_exhausted(self) -> list[Request]:
        """Requests finished with `length` by the scheduler since the last call."""
        done, self.exhausted = self.exhausted, []
        return done

    def schedule(self) -> list[ScheduledRequest]:
        out: list[ScheduledRequest] = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        self._admit_waiting(out, budget)
        return out

    # ---------------------------------------------------------------- running

    def _schedule_running(self, out: list[ScheduledRequest], budget: int) -> int:
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted by an earlier (older) request of this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.chunk)
            if n <= 0 or not self._grow(req, req.num_computed_tokens + n):
                continue
            out.append(ScheduledRequest(req, n))
            budget -= n
        return budget

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Blocks for `num_tokens`, preempting newer requests if needed; False if req was
        preempted (it is the newest) or finished (it filled the whole cache)."""
        if self._outgrows_cache(num_tokens):
            self._exhaust(req)
            return False
        need = cdiv(num_tokens, self.bt) - len(req.blocks)
        while need > 0:
            new = self.pool.allocate_n(need)
            if new is not None:
                req.blocks.extend(new)
                return True
            # alone, every used block is req's own and it fits (checked above): never here
            assert len(self.running) > 1, f"{req.request_id} cannot grow while running alone"
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _outgrows_cache(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.bt) > self.config.num_blocks

    def _exhaust(self, req: Request) -> None:
        req.finish_reason = FinishReason.LENGTH
        self.finish(req)
        self.exhausted.append(req)

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = req.num_cached_blocks = 0
        self.waiting.appendleft(req)

    def free(self, req: Request) -> None:
        self.pool.free_n(req.blocks)
        req.blocks = []

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.free(req)
        req.status = RequestStatus.FINISHED

    # ---------------------------------------------------------------- waiting

    def _admit_waiting(self, out: list[ScheduledRequest], budget: int) -> None:
        """FCFS with bounded skipping: a request whose blocks are not free is passed over by
        at most `max_admission_skips` later ones; then admission stops until it fits."""
        limit = self.config.max_admission_skips
        passed: list[Request] = []   # earlier requests still waiting for blocks
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs \
                    or any(p.num_skips >= limit for p in passed) or len(passed) > limit:
                return
            if self._outgrows_cache(req.num_tokens):
                self._exhaust(req)   # preempted with a cache's worth of tokens (TRUNCATE)
                continue
            n = self._admit(req, min(budget, self.chunk))
            if n is None:
                passed.append(req)
                continue
            for p in passed:
                p.num_skips += 1
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.append(ScheduledRequest(req, n))
            budget -= n

    def _admit_reading(self, req: Request, budget: int, local: list, max_hit: int) -> int | None:
        """`_admit` with the store's part of the prefix looked up and read in one round trip
        (`StoreConnector.load_prefix`) instead of MATCH, then GET: blocks are taken first,
        as many as a miss would take for the first chunk anyway, and the longest stored
        prefix is read into them; the ones past it serve the chunk or go back. Only when
        all of them hit does a second read take the rest of the prefix (the store holds a
        long one). When the blocks for a read or for the chunk are not free, nothing is
        admitted: what was loaded stays in the paged cache, a local hit the next time."""
        bt, hashes, pool = self.bt, req.block_hashes, self.pool
        first = len(local)
        pool.touch(local)
        loaded: list = []
        spare: list = []
        size = cdiv(min(req.num_tokens - first * bt, budget), bt)  # what a miss takes anyway
        while first + len(loaded) < max_hit:
            start = first + len(loaded)
            fresh = pool.allocate_n(min(max_hit - start, size))
            if fresh is None:
                pool.free_n(local + loaded)
                return None
            got = self.connector.load_prefix(hashes[start:start + len(fresh)],
                                             [b.block_id for b in fresh])
            pool.cache_n(fresh[:got], hashes[start:start + got])
            loaded += fresh[:got]
            spare = fresh[got:]
            if spare:
                break
            size = max_hit - first - len(loaded)  # all hit: the rest of the prefix at once
        cached = first + len(loaded)
        need = cdiv(min(req.num_tokens - cached * bt, budget), bt)
        if need > len(spare):
            more = pool.allocate_n(need - len(spare))
            if more is None:
                pool.free_n(local + loaded)
                pool.free_unused(spare)
                return None
            spare += more
        else:
            pool.free_unused(spare[need:])
            spare = spare[:need]
        req.blocks = local + loaded + spare
        return self._started(req, first, len(loaded), budget)

    def _admit(self, req: Request, budget: int) -> int | None:
        """Give `req` its cached prefix and blocks for its first chunk; the chunk's size, or
        None when the blocks are not free now."""
        max_hit = (req.num_tokens - 1) // self.bt  # compute at least one token (for logits)
        local = self.pool.get_cached_prefix(req.block_hashes[:max_hit])
        if self.connector is not None and self.connector.reads_prefix and len(local) < max_hit:
            return self._admit_reading(req, budget, local, max_hit)
        remote = 0
        if self.connector is not None and len(local) < max_hit:
            remote = self.connector.num_prefix_blocks(req.block_hashes[len(local):max_hit])
        hit_tokens = (len(local) + remote) * self.bt
        chunk = min(req.num_tokens - hit_tokens, budget)
        need = cdiv(hit_tokens + chunk, self.bt) - len(local)
        free_after_touch = self.pool.num_free - sum(b.ref_cnt == 0 for b in local)
        if need > free_after_touch:
            return None
        self.pool.touch(local)
        req.blocks = local + self.pool.allocate_n(need)
        loaded = 0
        if remote:
            loaded = self.connector.load(req.block_hashes[len(local):len(local) + remote],
                                         [b.block_id for b in req.blocks[len(local):len(local) + remote]])
            self.pool.cache_n(req.blocks[len(local):len(local) + loaded],
                              req.block_hashes[len(local):len(local) + loaded])
        return self._started(req, len(local), loaded, budget)

    def _started(self, req: Request, num_local: int, num_loaded: int, budget: int) -> int:
        """Record what an admitted `req` starts from (its local hits, then the blocks loaded
        from the store); its first chunk's size."""
        req.num_cached_blocks = num_local + num_loaded
        req.num_computed_tokens = req.num_cached_blocks * self.bt
        req.num_local_hit_tokens = num_local * self.bt
        req.num_loaded_tokens = num_loaded * self.bt
        return min(req.num_tokens - req.num_computed_tokens, budget)
