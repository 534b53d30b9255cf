"""Discrete-event simulator of N prefill + M decode instances replaying a request trace.

The policy under test is the same object the live scheduler uses: it reads a `ClusterView`
built from the simulated instances and the real `ClusterIndex`, which the simulated caches
feed with KV events. What is modeled:
- each prefill instance runs one prefill at a time, FIFO; its duration is the cost model's
  prefill time of the uncached suffix given the reused prefix;
- each prefill instance has an LRU block cache (optionally one more shared pool node);
  a request reuses its local prefix and, when the placement says so, fetches further blocks
  from another node at the modeled bandwidth, starting when those blocks are ready there
  and overlapping the queue wait; fetched and computed blocks are then cached locally
  (so a fetched hot prefix is replicated);
- decode instances batch continuously (see `DecodeInstance`); a sequence waits when its KV
  does not fit. TTFT = prefill end - arrival; TBT = (finish - prefill end) / decode steps.
Not modeled: KV transfer from prefill to decode, chunked/pipelined prefill, network
contention, cost-model error (the policy's estimates are exact).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.index import ClusterIndex
from kvstore.scheduler.base import (ClusterView, DecodeLoad, Placement, Policy, PrefillLoad,
                                    RejectReason, RouteRequest, SchedulerConfig, cached_tokens)
from kvstore.scheduler.sim_instances import BlockCache, DecodeInstance, PrefillInstance

POOL_NODE = "pool"


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int = 8
    num_decode: int = 8
    prefill_cache_blocks: int = 4096  # per prefill instance (LRU)
    pool_blocks: int = 0  # a shared pool node every prefill writes to; 0 = none
    decode_capacity_tokens: int = 1_300_000  # KV tokens per decode instance
    speedup: float = 1.0  # trace time is divided by this
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.num_prefill <= 0 or self.num_decode <= 0:
            raise ValueError("SimConfig needs at least one prefill and one decode instance")
        if self.prefill_cache_blocks <= 0 or self.pool_blocks < 0:
            raise ValueError("SimConfig cache sizes must be > 0 (pool_blocks >= 0)")
        if self.decode_capacity_tokens <= 0:
            raise ValueError("SimConfig decode_capacity_tokens must be > 0")
        if not 1e-3 <= self.speedup <= 1e6:  # (NaN, inf, 1e-300: a clock that no step moves)
            raise ValueError(f"SimConfig speedup must be within 1e-3..1e6, not {self.speedup}")


class RequestOutcome(NamedTuple):
    request_id: int
    arrival_s: float
    reject: RejectReason | None
    prefill_node: str | None = None
    prefill_start_s: float = 0.0
    first_token_s: float = 0.0
    finish_s: float = 0.0
    total_blocks: int = 0
    hit_blocks: int = 0  # reused: local prefix + fetched
    fetched_blocks: int = 0
    decode_steps: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tbt_s(self) -> float | None:
        if self.decode_steps <= 0:
            return None
        return (self.finish_s - self.first_token_s) / self.decode_steps


class _Event(NamedTuple):
    time_s: float
    order: int
    request_id: int  # PREFILL_DONE when >= 0; decode check of instance -1-request_id
    version: int


class Simulator:
    def __init__(self, config: SimConfig, policy: Policy) -> None:
        self.config, self.policy = config, policy
        self.index = ClusterIndex()
        cap = config.prefill_cache_blocks
        self.prefill = [PrefillInstance(f"p{i}", BlockCache(f"p{i}", cap, self.index))
                        for i in range(config.num_prefill)]
        self.caches = {p.node_id: p.cache for p in self.prefill}
        self.pool = None
        if config.pool_blocks:
            self.pool = BlockCache(POOL_NODE, config.pool_blocks, self.index)
            self.caches[POOL_NODE] = self.pool
        decode_cost = config.scheduler.cost.decode
        self.decode = [DecodeInstance(f"d{i}", config.decode_capacity_tokens, decode_cost)
                       for i in range(config.num_decode)]
        self._by_node = {p.node_id: p for p in self.prefill}
        self._decode_by_node = {d.node_id: i for i, d in enumerate(self.decode)}
        self._events: list[_Event] = []
        self._order = 0
        self._clock_s = 0.0
        self._pending: dict[int, tuple[RequestOutcome, int, int]] = {}  # rid -> (.., dec, kv)
        self.outcomes: dict[int, RequestOutcome] = {}

    # ---- main loop ----------------------------------------------------------------------
    def run(self, requests: Sequence[RouteRequest], progress=None) -> list[RequestOutcome]:
        """Replay `requests` (sorted by arrival); one outcome per request, by request id."""
        speed = self.config.speedup
        for req in requests:
            now = req.arrival_s / speed
            while self._events and self._events[0].time_s <= now:
                self._handle(heapq.heappop(self._events))
            self._tick(now)
            self._dispatch(req, now)
            if progress is not None:
                progress.update(1)
        while self._events:
            self._handle(heapq.heappop(self._events))
        assert not self._pending, "every dispatched request must finish"
        return [self.outcomes[r.request_id] for r in requests]

    def _tick(self, now_s: float) -> None:
        assert now_s >= self._clock_s - 1e-9, "simulated time went backwards"
        self._clock_s = max(self._clock_s, now_s)

    def _push(self, time_s: float, request_id: int, version: int = 0) -> None:
        self._order += 1
        heapq.heappush(self._events, _Event(time_s, self._order, request_id, version))

    def _handle(self, event: _Event) -> None:
        self._tick(event.time_s)
        if event.request_id >= 0:
            outcome, dec, kv = self._pending[event.request_id]
            self.decode[dec].arrive(event.request_id, kv, outcome.decode_steps, event.time_s)
            self._schedule_decode(dec)
            return
        dec = -1 - event.request_id
        instance = self.decode[dec]
        if event.version != instance.version:
            return  # superseded by a later change of that batch
        for rid in instance.pop_finished(event.time_s):
            outcome, _, kv = self._pending.pop(rid)
            instance.assigned -= 1
            instance.assigned_tokens -= kv
            self._record(outcome._replace(finish_s=event.time_s))
        self._schedule_decode(dec)

    def _schedule_decode(self, dec: int) -> None:
        instance = self.decode[dec]
        when = instance.next_finish_s()
        if when is not None:
            self._push(max(when, self._clock_s), -1 - dec, instance.version)

    def _record(self, outcome: RequestOutcome) -> None:
        assert outcome.request_id not in self.outcomes, "a request finished twice"
        self.outcomes[outcome.request_id] = outcome

    # ---- one request --------------------------------------------------------------------
    def _view(self, now_s: float) -> ClusterView:
        prefill = tuple(PrefillLoad(p.node_id, p.queue_s(now_s)) for p in self.prefill)
        decode = tuple(DecodeLoad(d.node_id, d.assigned, d.assigned_tokens, d.capacity_tokens)
                       for d in self.decode)
        return ClusterView(prefill, decode, self.index)

    def _dispatch(self, req: RouteRequest, now_s: float) -> None:
        placement = self.policy.place(req, self._view(now_s))
        if placement.reject is not None:
            self._record(RequestOutcome(req.request_id, now_s, placement.reject,
                                        total_blocks=len(req.block_hashes)))
            return
        outcome = self._prefill(req, placement, now_s)
        dec = self._decode_by_node[placement.decode_node]
        kv = req.input_tokens + req.output_tokens
        self.decode[dec].assigned += 1
        self.decode[dec].assigned_tokens += kv
        self._pending[req.request_id] = (outcome, dec, kv)
        self._push(outcome.first_token_s, req.request_id)

    def _prefill(self, req: RouteRequest, placement: Placement, now_s: float) -> RequestOutcome:
        cost = self.config.scheduler.cost
        instance = self._by_node[placement.prefill_node]
        hashes = req.block_hashes
        local = instance.cache.prefix(hashes)
        ready = instance.cache.ready_s(hashes[:local])
        fetched, fetch_done = self._fetch(req, placement, local, now_s)
        hit = local + fetched
        cached = cached_tokens(req, hit, cost.block_tokens)
        start = max(now_s, instance.busy_until_s, ready, fetch_done)
        end = start + cost.prefill.time_s(req.input_tokens - cached, cached)
        instance.busy_until_s = end
        instance.cache.touch(hashes[:local])
        instance.cache.insert(hashes[local:hit], fetch_done)
        instance.cache.insert(hashes[hit:], end)
        if self.pool is not None:
            self.pool.insert(hashes, end)
        return RequestOutcome(req.request_id, now_s, None, instance.node_id, start, end,
                              total_blocks=len(hashes), hit_blocks=hit,
                              fetched_blocks=fetched,
                              decode_steps=max(req.output_tokens - 1, 0))

    def _fetch(self, req: RouteRequest, placement: Placement, local: int,
               now_s: float) -> tuple[int, float]:
        """Fetch what the placement asked for and the source still holds: (blocks, done)."""
        if placement.fetch_node is None or placement.fetch_blocks <= 0:
            return 0, now_s
        source = self.caches[placement.fetch_node]
        want = placement.cached_blocks + placement.fetch_blocks - local
        count = min(source.prefix(req.block_hashes, local), max(want, 0))
        if count <= 0:
            return 0, now_s
        blocks = req.block_hashes[local:local + count]
        source.touch(blocks)
        cost = self.config.scheduler.cost
        seconds = cost.transfer.fetch_s([source.tier] * count, cost.block_bytes)
        return count, max(now_s, source.ready_s(blocks)) + seconds


def simulate(requests: Sequence[RouteRequest], policy: Policy, config: SimConfig,
             progress=None) -> list[RequestOutcome]:
    """Run one policy over `requests`; see `Simulator`."""
    return Simulator(config, policy).run(requests, progress)
