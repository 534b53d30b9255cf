"""The router: where each request goes, what every worker is doing, and who is still alive.

Placement is a `kvstore.scheduler` policy (conductor by default) over a `ClusterView`:
- prefill load: seconds of prefill queued on each worker (the cost model's estimate of each
  in-flight prefill, uncached part only);
- decode load: running streams and the KV tokens they hold on each decode worker;
- the block index: a `ClusterIndex` fed by real KV events (`serving.event_feed`): each
  prefill-capable worker's paged cache (node = worker name, tier GPU) and, when there is a
  pool, the store node's tiers (node `pool`). Only the pool can hand blocks to another
  worker, so it is the only fetch source. The conductor weighs "this worker already has
  the prefix" against "fetch it from the pool while queued" against "recompute", which is
  what the engine then does: local cache first, then the pool, then compute.
The cost model is fitted at start to the timings each worker measured (`serving.costs`).
"""
from __future__ import annotations

import asyncio
import logging
import subprocess
from dataclasses import dataclass, field
from typing import AsyncIterator, NamedTuple

import aiohttp

from engine_adapter.serving.costs import describe, fit_cost_model
from engine_adapter.serving.event_feed import KVEventFeed
from engine_adapter.serving.protocol import (MSGPACK, GenerateRequest, PrefillResult, Role,
                                             TokenEvent, WorkerInfo, read_frame)
from kvstore.index import ClusterIndex
from kvstore.scheduler import (ClusterView, DecodeLoad, Placement, PolicyKind, PrefillLoad,
                               RouteRequest, SchedulerConfig, make_policy)
from kvstore.scheduler.base import prefill_estimate_s
from kvstore.scheduler.cost_model import CostModel

log = logging.getLogger("kvtier.cluster")
POOL_NODE = "pool"


class Estimate(NamedTuple):
    """What the cost model expects a placed request to cost its prefill worker."""

    prefill_s: float      # its prefill (the uncached part)
    decode_s: float       # its decode, when the same worker decodes it (colocated), else 0


class WorkerDiedError(RuntimeError):
    """The worker serving a request went away (process exit or lost connection)."""


class WorkerRejectedError(ValueError):
    """A worker refused a request as invalid (HTTP 400); the message says why."""


class NoWorkerError(RuntimeError):
    """No live worker of the needed role is left."""


@dataclass(eq=False)  # identity: handles go in sets
class WorkerHandle:
    name: str
    role: Role
    url: str
    proc: subprocess.Popen | None = None
    info: WorkerInfo | None = None
    alive: bool = True
    responsive: bool = True         # answered a health check within the router's timeout
    answered_at: float = 0.0        # loop time of its last answer to a health check
    silent: asyncio.Event | None = None  # set while it is out of service for silence
    booked: dict = field(default_factory=dict)  # request -> estimated seconds it still needs
    streams: int = 0                # running decode streams
    kv_tokens: int = 0              # KV tokens those streams hold
    inflight: int = 0               # requests using this worker right now

    @property
    def queued_s(self) -> float:
        """Seconds of work booked on this worker (exactly 0 when none: no float residue
        tilting a tie between idle workers)."""
        return sum(self.booked.values())

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else (self.info.pid if self.info else None)


class Router:
    def __init__(self, workers: list[WorkerHandle], policy: PolicyKind = PolicyKind.CONDUCTOR,
                 pooled: bool = True, store_control_url: str | None = None,
                 worker_timeout_s: float = 15.0) -> None:
        self.workers, self.pooled = workers, pooled
        self.worker_timeout_s = worker_timeout_s
        self.policy_kind, self.store_control_url = policy, store_control_url
        self.index = ClusterIndex()
        self.cost: CostModel | None = None
        self._session: aiohttp.ClientSession | None = None
        self._probes: aiohttp.ClientSession | None = None
        self._policy = None
        self._feed: KVEventFeed | None = None
        self._tasks: list[asyncio.Task] = []
        self._next_id = 0

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self, timeout_s: float = 600.0) -> None:
        """Wait until every worker answers /info, fit the cost model to what they
        measured, then follow the KV events of the workers and the store node."""
        self.open_sessions()
        await asyncio.gather(*(self._wait_ready(w, timeout_s) for w in self.workers))
        info = self.workers[0].info
        ns = info.ns
        self.cost = fit_cost_model([w.info for w in self.workers], info.block_tokens,
                                   ns.block_bytes)
        self._policy = make_policy(self.policy_kind, SchedulerConfig(cost=self.cost))
        self._feed = KVEventFeed(self.index, self._session)
        for w in self.live(Role.PREFILL, Role.COLOCATED):
            self._feed.add(w.name, w.url + "/kv/events")
        if self.store_control_url:
            self._feed.add(POOL_NODE, self.store_control_url + "/kv/events", ns=f"{ns.ns_id:x}")
        await self._feed.poll_all()
        self._tasks.append(asyncio.create_task(self._feed.run(), name="kv-event-feed"))

    def open_sessions(self) -> None:
        """The HTTP sessions to the workers (`start` opens them)."""
        # (no connection cap: the front end's own bounds how many requests are in flight;
        # aiohttp's default of 100 had queued the 101st stream behind the others)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10),
                                              connector=aiohttp.TCPConnector(limit=0))
        # health checks on connections of their own: behind the streams' they had waited
        # for a free one until they timed out, and a loaded cluster took every worker out
        self._probes = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    def cost_summary(self) -> str:
        return describe(self.cost) if self.cost is not None else "cost model not fitted yet"

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self._probes is not None:
            await self._probes.close()

    async def _wait_ready(self, w: WorkerHandle, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if w.proc is not None and w.proc.poll() is not None:
                raise WorkerDiedError(f"worker {w.name} exited with code {w.proc.returncode} "
                                      "while starting; see its output above")
            try:
                async with self._session.get(w.url + "/info") as r:
                    w.info = WorkerInfo.decode(await r.read())
                    return
            except aiohttp.ClientError:
                await asyncio.sleep(0.25)
        raise WorkerDiedError(f"worker {w.name} did not answer {w.url}/info in {timeout_s:.0f} s")

    async def watch(self, period_s: float = 0.2) -> None:
        """Report workers whose process exited, and take out of service the ones that stop
        answering health checks (a stopped or hung process: its requests had waited for
        good, and new ones were still sent to it); the rest of the cluster keeps serving."""
        loop = asyncio.get_running_loop()
        probes: dict[str, asyncio.Task] = {}
        for w in self.workers:
            w.answered_at = loop.time()
            w.silent = asyncio.Event()
        next_probe = loop.time()
        while True:
            for w in self.workers:
                if w.alive and w.proc is not None and w.proc.poll() is not None:
                    self.mark_dead(w, f"exited with code {w.proc.returncode}")
            if loop.time() >= next_probe:
                next_probe = loop.time() + self.worker_timeout_s / 5
                for w in self.workers:
                    if w.alive and (w.name not in probes or probes[w.name].done()):
                        probes[w.name] = asyncio.create_task(self._probe(w))
            for w in self.workers:
                if w.alive and w.responsive and (loop.time() - w.answered_at
                                                 > self.worker_timeout_s):
                    self._mark_silent(w)
            await asyncio.sleep(period_s)

    async def _probe(self, w: WorkerHandle) -> None:
        """One health check (GET /info, answered by the worker's event loop, not its engine
        thread: a long step does not delay it)."""
        try:
            async with self._probes.get(w.url + "/info", timeout=aiohttp.ClientTimeout(
                    total=self.worker_timeout_s)) as r:
                await r.read()
                if r.status != 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return
        w.answered_at = asyncio.get_running_loop().time()
        if not w.responsive and w.alive:
            w.responsive = True
            w.silent = asyncio.Event()
            log.warning("worker %s (pid %s) answers again: back in service", w.name, w.pid)

    def _mark_silent(self, w: WorkerHandle) -> None:
        w.responsive = False
        if w.silent is not None:
            w.silent.set()  # (its requests in flight end: see _guard)
        left = ", ".join(x.name for x in self.workers if x.alive and x.responsive) or "none"
        log.error("worker %s (pid %s) answered no health check for %.0f s: out of service, "
                  "its requests fail with 'worker_failed' (it comes back once it answers); "
                  "still serving: %s", w.name, w.pid, self.worker_timeout_s, left)

    async def _guard(self, w: WorkerHandle, aw):
        """`await aw`, or WorkerDiedError once `w` is taken out of service for silence."""
        silent = w.silent
        if silent is None:
            return await aw
        if silent.is_set():
            close = getattr(aw, "close", None)  # a coroutine, or aiohttp's request (never
            if callable(close):  # awaited: said so, as a warning, at collection)
                close()
            raise self._silent_error(w)
        task, stop = asyncio.ensure_future(aw), asyncio.ensure_future(silent.wait())
        try:
            await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
            stop.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        raise self._silent_error(w)

    def _silent_error(self, w: WorkerHandle) -> WorkerDiedError:
        return WorkerDiedError(f"{w.role.value} worker {w.name} (pid {w.pid}) answered no health "
                               f"check for {self.worker_timeout_s:.0f} s; retry the request: "
                               "the cluster keeps serving on the remaining workers")

    def mark_dead(self, w: WorkerHandle, why: str) -> None:
        if not w.alive:
            return
        w.alive = False
        if self._feed is not None:
            self._feed.remove(w.name)
        left = ", ".join(x.name for x in self.workers if x.alive) or "none"
        log.error("worker %s (pid %s) %s; requests on it fail with 'worker_failed'; "
                  "still serving: %s", w.name, w.pid, why, left)

    def live(self, *roles: Role) -> list[WorkerHandle]:
        return [w for w in self.workers if w.alive and w.responsive and w.role in roles]

    # ---- placement ----------------------------------------------------------------------
    def place(self, prompt_hashes: tuple[bytes, ...], num_prompt_tokens: int,
              max_tokens: int) -> tuple[WorkerHandle, WorkerHandle, Placement, Estimate]:
        """(prefill worker, decode worker, placement, what it costs the prefill worker)."""
        roles = (Role.COLOCATED,) if self.workers[0].role is Role.COLOCATED else (Role.PREFILL,)
        prefill = self.live(*roles)
        decode = prefill if roles == (Role.COLOCATED,) else self.live(Role.DECODE)
        if not prefill or not decode:
            raise NoWorkerError(f"no live {'prefill' if not prefill else 'decode'} worker is left; "
                                "restart the cluster (see the log for which worker died and why)")
        self._next_id += 1
        req = RouteRequest(self._next_id, 0.0, num_prompt_tokens, max_tokens, prompt_hashes)
        view = ClusterView(
            tuple(PrefillLoad(w.name, w.queued_s) for w in prefill),
            tuple(DecodeLoad(w.name, w.streams, w.kv_tokens,
                             w.info.num_blocks * w.info.block_tokens) for w in decode),
            self.index, sources=frozenset({POOL_NODE}) if self.pooled else frozenset())
        p = self._policy.place(req, view)
        by_name = {w.name: w for w in self.workers}
        pw = by_name[p.prefill_node]
        dw = pw if roles == (Role.COLOCATED,) else by_name[p.decode_node]
        prefill_s = prefill_estimate_s(req, p.cached_blocks + p.fetch_blocks, self.cost)
        decode_s = (max_tokens * self.cost.decode.step_s(1, num_prompt_tokens + max_tokens)
                    if dw is pw else 0.0)
        return pw, dw, p, Estimate(prefill_s, decode_s)

    # ---- calls to workers ---------------------------------------------------------------
    async def prefill(self, w: WorkerHandle, g: GenerateRequest) -> PrefillResult:
        try:
            async with await self._guard(w, self._session.post(
                    w.url + "/prefill", data=g.encode(), headers={"Content-Type": MSGPACK})) as r:
                body = await self._guard(w, r.read())
                if r.status == 400:
                    raise WorkerRejectedError(body.decode(errors="replace"))
                if r.status != 200:
                    raise WorkerDiedError(f"prefill worker {w.name} answered HTTP {r.status}")
                return PrefillResult.decode(body)
        except (aiohttp.ClientError, asyncio.IncompleteReadError) as e:
            raise self._died(w, e) from e

    async def stream(self, w: WorkerHandle, path: str, body: bytes) -> AsyncIterator[TokenEvent]:
        try:
            async with await self._guard(w, self._session.post(
                    w.url + path, data=body, headers={"Content-Type": MSGPACK})) as r:
                if r.status == 400:
                    raise WorkerRejectedError((await r.read()).decode(errors="replace"))
                if r.status != 200:
                    raise WorkerDiedError(f"worker {w.name} answered HTTP {r.status}")
                while True:
                    ev = await self._guard(w, read_frame(r.content, TokenEvent))
                    w.answered_at = asyncio.get_running_loop().time()  # (it answers)
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
