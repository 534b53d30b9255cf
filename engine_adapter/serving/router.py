"""The router: where each request goes, what every worker is doing, and who is still alive.

Placement is a `kvstore.scheduler` policy (conductor by default) over a `ClusterView`:
- prefill load: seconds of prefill queued on each worker (uncached prompt tokens of its
  in-flight prefills through the cost model);
- decode load: running streams and the KV tokens they hold on each decode worker;
- the block index: a `ClusterIndex` the router feeds itself. Each prefill (or colocated)
  worker reports the full prompt blocks it just held; the router mirrors each worker's
  paged cache as an LRU of the worker's block capacity (node = worker name, tier GPU: the
  engine's own cache) and, in pool mode, the store node (node `pool`, tier DRAM). So the
  conductor weighs "this worker already has the prefix" against "the pool has it, fetch it
  while queued" against "recompute", which is what the engine then does: local cache
  first, then the pool, then compute.
The mirror is an estimate: engine-side evictions are inferred from the LRU, pool evictions
are not seen (the pool is sized to hold the working set).
"""
from __future__ import annotations

import asyncio
import logging
import subprocess
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp

from engine_adapter.serving.protocol import (MSGPACK, GenerateRequest, PrefillResult, Role,
                                             TokenEvent, WorkerInfo, pack, read_frame, unpack)
from kvstore.events import EventKind, KVEvent, TierKind
from kvstore.index import ClusterIndex
from kvstore.scheduler import (ClusterView, DecodeLoad, Placement, PolicyKind, PrefillLoad,
                               Request, SchedulerConfig, make_policy)
from kvstore.scheduler.cost_model import (CostModel, DecodeCost, LinkCost, PrefillCost,
                                          TransferCost)

log = logging.getLogger("kvtier.cluster")
POOL_NODE = "pool"


class WorkerDiedError(RuntimeError):
    """The worker serving a request went away (process exit or lost connection)."""


class WorkerRejectedError(ValueError):
    """A worker refused a request as invalid (HTTP 400); the message says why."""


class NoWorkerError(RuntimeError):
    """No live worker of the needed role is left."""


def smollm2_cpu_cost(block_tokens: int, block_bytes: int) -> CostModel:
    """Rough figures for SmolLM2-135M on one core of the 2-core dev box (fit your own with
    `kvstore.scheduler.cost_model.fit_*`): ~500 prompt tokens/s, ~30 decode steps/s, the
    pool over shared memory at a few GB/s."""
    return CostModel(
        prefill=PrefillCost(base_s=0.02, per_token_s=2e-3, per_token_pair_s=2e-7),
        decode=DecodeCost(base_s=0.03, per_seq_s=3e-3, per_kv_token_s=1e-6),
        transfer=TransferCost(gpu=LinkCost(1e-3, 3e9), dram=LinkCost(1e-3, 3e9),
                              ssd=LinkCost(2e-3, 1e9)),
        block_tokens=block_tokens, block_bytes=block_bytes)


@dataclass(eq=False)  # identity: handles go in sets
class WorkerHandle:
    name: str
    role: Role
    url: str
    proc: subprocess.Popen | None = None
    info: WorkerInfo | None = None
    alive: bool = True
    queued_tokens: int = 0          # uncached prompt tokens of in-flight prefills
    streams: int = 0                # running decode streams
    kv_tokens: int = 0              # KV tokens those streams hold
    inflight: int = 0               # requests using this worker right now

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else (self.info.pid if self.info else None)


class _CacheMirror:
    """LRU of the blocks one node holds, emitting the KV events that keep the index in step."""

    def __init__(self, node_id: str, capacity: int | None, tier: TierKind) -> None:
        self.node_id, self.capacity, self.tier = node_id, capacity, tier
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.seq = 0

    def touch(self, hashes: tuple[bytes, ...]) -> list[KVEvent]:
        new = [h for h in hashes if h not in self.blocks]
        for h in reversed(hashes):  # the root ends most recent: a chain's tail is evicted first
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        events = [self._event(EventKind.STORED, tuple(new))] if new else []
        if self.capacity is not None and len(self.blocks) > self.capacity:
            excess = len(self.blocks) - self.capacity
            gone = [self.blocks.popitem(last=False)[0] for _ in range(excess)]
            events.append(self._event(EventKind.REMOVED, tuple(gone)))
        return events

    def _event(self, kind: EventKind, hashes: tuple[bytes, ...]) -> KVEvent:
        ev = KVEvent(kind, self.node_id, self.seq, self.tier, hashes)
        self.seq += 1
        return ev


@dataclass
class RouterStats:
    worker_deaths: list[str] = field(default_factory=list)


class Router:
    def __init__(self, workers: list[WorkerHandle], policy: PolicyKind = PolicyKind.CONDUCTOR,
                 pooled: bool = True) -> None:
        self.workers, self.pooled = workers, pooled
        self.policy_kind = policy
        self.index = ClusterIndex()
        self._mirrors: dict[str, _CacheMirror] = {}
        self._session: aiohttp.ClientSession | None = None
        self._policy = None
        self._cost: CostModel | None = None
        self._next_id = 0

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self, timeout_s: float = 600.0) -> None:
        """Wait until every worker answers /info, then set up the policy and mirrors."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10))
        await asyncio.gather(*(self._wait_ready(w, timeout_s) for w in self.workers))
        info = self.workers[0].info
        from kvstore.keys import Namespace
        ns = Namespace(*info.ns_fields)
        self._cost = smollm2_cpu_cost(info.block_tokens, ns.block_bytes)
        self._policy = make_policy(self.policy_kind, SchedulerConfig(cost=self._cost))
        for w in self.workers:
            if w.role in (Role.PREFILL, Role.COLOCATED):
                self._mirrors[w.name] = _CacheMirror(w.name, w.info.num_blocks, TierKind.GPU)
        if self.pooled:
            self._mirrors[POOL_NODE] = _CacheMirror(POOL_NODE, None, TierKind.DRAM)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _wait_ready(self, w: WorkerHandle, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if w.proc is not None and w.proc.poll() is not None:
                raise WorkerDiedError(f"worker {w.name} exited with code {w.proc.returncode} "
                                      "while starting; see its output above")
            try:
                async with self._session.get(w.url + "/info") as r:
                    w.info = unpack(WorkerInfo, await r.read())
                    return
            except aiohttp.ClientError:
                await asyncio.sleep(0.25)
        raise WorkerDiedError(f"worker {w.name} did not answer {w.url}/info in {timeout_s:.0f} s")

    async def watch(self, period_s: float = 0.2) -> None:
        """Report workers whose process exited; the rest of the cluster keeps serving."""
        while True:
            for w in self.workers:
                if w.alive and w.proc is not None and w.proc.poll() is not None:
                    self.mark_dead(w, f"exited with code {w.proc.returncode}")
            await asyncio.sleep(period_s)

    def mark_dead(self, w: WorkerHandle, why: str) -> None:
        if not w.alive:
            return
        w.alive = False
        if w.name in self._mirrors:
            if w.name in self.index.node_ids():
                self.index.remove_node(w.name)
            del self._mirrors[w.name]
        left = ", ".join(x.name for x in self.workers if x.alive) or "none"
        log.error("worker %s (pid %s) %s; requests on it fail with 'worker_failed'; "
                  "still serving: %s", w.name, w.pid, why, left)

    def live(self, *roles: Role) -> list[WorkerHandle]:
        return [w for w in self.workers if w.alive and w.role in roles]

    # ---- placement ----------------------------------------------------------------------
    def place(self, prompt_hashes: tuple[bytes, ...], num_prompt_tokens: int,
              max_tokens: int) -> tuple[WorkerHandle, WorkerHandle, Placement]:
        roles = (Role.COLOCATED,) if not self.pooled else (Role.PREFILL,)
        prefill = self.live(*roles)
        decode = self.live(Role.DECODE) if self.pooled else prefill
        if not prefill or not decode:
            raise NoWorkerError(f"no live {'prefill' if not prefill else 'decode'} worker is left; "
                                "restart the cluster (see the log for which worker died and why)")
        self._next_id += 1
        req = Request(self._next_id, 0.0, num_prompt_tokens, max_tokens, prompt_hashes)
        view = ClusterView(
            tuple(PrefillLoad(w.name, self._cost.prefill.time_s(w.queued_tokens, 0)
                              if w.queued_tokens else 0.0) for w in prefill),
            tuple(DecodeLoad(w.name, w.streams, w.kv_tokens,
                             w.info.num_blocks * w.info.block_tokens) for w in decode),
            self.index)
        p = self._policy.place(req, view)
        by_name = {w.name: w for w in self.workers}
        pw = by_name[p.prefill_node]
        dw = pw if not self.pooled else by_name[p.decode_node]
        return pw, dw, p

    def report_blocks(self, w: WorkerHandle, hashes: tuple[bytes, ...]) -> None:
        """A worker now holds `hashes` (and, in pool mode, published them to the pool)."""
        for node in (w.name, POOL_NODE if self.pooled else None):
            mirror = self._mirrors.get(node) if node else None
            if mirror is not None:
                for ev in mirror.touch(hashes):
                    self.index.apply(ev)

    # ---- calls to workers ---------------------------------------------------------------
    async def prefill(self, w: WorkerHandle, g: GenerateRequest) -> PrefillResult:
        try:
            async with self._session.post(w.url + "/prefill", data=pack(g),
                                          headers={"Content-Type": MSGPACK}) as r:
                body = await r.read()
                if r.status == 400:
                    raise WorkerRejectedError(body.decode(errors="replace"))
                if r.status != 200:
                    raise WorkerDiedError(f"prefill worker {w.name} answered HTTP {r.status}")
                return unpack(PrefillResult, body)
        except (aiohttp.ClientError, asyncio.IncompleteReadError) as e:
            raise self._died(w, e) from e

    async def stream(self, w: WorkerHandle, path: str, body: bytes) -> AsyncIterator[TokenEvent]:
        try:
            async with self._session.post(w.url + path, data=body,
                                          headers={"Content-Type": MSGPACK}) as r:
                if r.status == 400:
                    raise WorkerRejectedError((await r.read()).decode(errors="replace"))
                if r.status != 200:
                    raise WorkerDiedError(f"worker {w.name} answered HTTP {r.status}")
                while True:
                    ev = await read_frame(r.content, TokenEvent)
                    if ev is None:
                        raise WorkerDiedError(f"worker {w.name} ended the stream early")
                    if ev.error:
                        raise WorkerRejectedError(ev.error)
                    yield ev
                    if ev.finished:
                        return
        except (aiohttp.ClientError, asyncio.IncompleteReadError) as e:
            raise self._died(w, e) from e

    def _died(self, w: WorkerHandle, e: BaseException) -> WorkerDiedError:
        if w.proc is not None and w.proc.poll() is not None:
            self.mark_dead(w, f"exited with code {w.proc.returncode}")
        log.warning("a request on worker %s failed: lost the connection (%s)", w.name,
                    type(e).__name__)
        return WorkerDiedError(f"{w.role.value} worker {w.name} (pid {w.pid}) went away during "
                               f"the request ({type(e).__name__}); retry it: the cluster keeps "
                               "serving on the remaining workers")
