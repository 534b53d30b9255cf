"""A worker process: one engine behind a tiny aiohttp server on a loopback port.

    python -m engine_adapter.serving.worker --role prefill --name prefill-0 --port 9001 \
        --store kvtier://127.0.0.1:7481

With `--port 0 --port-file F` (what `kvtier cluster` runs) the kernel picks the port and
the worker writes it to F before loading the model (`serving.ports`).

Routes: GET /info (WorkerInfo, with the timings measured at start), POST /prefill
(GenerateRequest -> PrefillResult, role prefill), POST /decode (Handoff bytes -> TokenEvent
frames, role decode), POST /generate (GenerateRequest -> TokenEvent frames, role
colocated), GET /kv/events?after=SEQ (the paged cache's KV events, `serving.kv_events`).
Bodies are msgpack (`serving.protocol`). A client that disconnects aborts its request.

The prefill answers as soon as the first token is sampled: the prompt's blocks have been
streaming to the pool chunk by chunk (the connector's background saves) and only the last
chunk's may still be on their way. The decode worker starts on the handoff at once and
waits for just those blocks to be committed before its engine loads the prefix.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass, replace

import msgspec
import torch
from aiohttp import web

from engine_adapter.config import EngineConfig
from engine_adapter.errors import InvalidRequestError
from engine_adapter.request import Request, shown_text
from engine_adapter.sampling import SamplingParams
from engine_adapter.serving.calibrate import Calibration, calibrate
from engine_adapter.serving.engine_loop import EngineLoop
from engine_adapter.serving.kv_events import CacheEventLog
from engine_adapter.serving.ports import bind, write_port_file
from kvstore import lifetime
from kvstore.cluster.messages import EVENTS_KIND_HEADER
from engine_adapter.serving.protocol import (MSGPACK, GenerateRequest, MessageError, PrefillResult,
                                             Role, TokenEvent, WorkerInfo, frame)
from engine_adapter.workers import Handoff


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    role: Role
    port: int
    host: str = "127.0.0.1"
    store_url: str | None = None      # required for prefill / decode
    num_blocks: int = 512
    max_num_seqs: int = 16
    chunk_tokens: int = 256           # prefill chunk: a request computes at most this per step
    threads: int = 1
    calibrate: bool = True            # measure prefill / decode / pool timings at start

    def __post_init__(self) -> None:
        if self.role is not Role.COLOCATED and not self.store_url:
            raise ValueError(f"a {self.role.value} worker needs --store (the pool's kvtier:// URL)")


LOOP_KEY = web.AppKey("loop", EngineLoop)
INFO_KEY = web.AppKey("info", WorkerInfo)
EVENTS_KEY = web.AppKey("events", CacheEventLog)
BLOCK_WAIT_S = 10.0      # a decode waits this long for a handoff's last blocks, then recomputes
BLOCK_POLL_S = 0.002


def build_engine(cfg: WorkerConfig):
    from engine_adapter.engine import LLMEngine
    from engine_adapter.serving.model_cache import load_cached
    from kvstore.keys import Namespace

    torch.set_num_threads(cfg.threads)
    torch.set_num_interop_threads(1)
    model, tokenizer = load_cached()
    # a step holds one long prefill's chunk and as much again for decodes and short prefills
    ecfg = EngineConfig(num_blocks=cfg.num_blocks, max_num_seqs=cfg.max_num_seqs,
                        max_num_batched_tokens=2 * cfg.chunk_tokens,
                        max_prefill_chunk_tokens=cfg.chunk_tokens)
    store = None
    if cfg.store_url:
        from kvstore.client import Client
        mc = model.config
        ns = Namespace(mc.name, mc.num_layers, mc.num_kv_heads, mc.head_dim, ecfg.dtype,
                       ecfg.block_tokens, revision=mc.revision, tenant=ecfg.tenant)
        store = Client(cfg.store_url, namespace=ns)
    return LLMEngine(model, ecfg, tokenizer=tokenizer, store=store)


def create_app(cfg: WorkerConfig, engine,
               calibration: Calibration | None = None) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    ns, c = engine.ns, calibration or Calibration((), (), ())
    app[INFO_KEY] = WorkerInfo(cfg.name, cfg.role, engine.model.config.name, os.getpid(),
                               engine.config.num_blocks, engine.config.block_tokens,
                               engine.max_model_len, ns, cfg.threads, c.prefill, c.decode, c.load)
    app[EVENTS_KEY] = events = CacheEventLog(cfg.name, ns.ns_id, engine.pool.cached)
    events.update()  # what calibration left in the cache is the starting point

    async def engine_ctx(app: web.Application):
        app[LOOP_KEY] = EngineLoop(engine, after_step=events.update)
        yield
        await asyncio.get_running_loop().run_in_executor(None, app[LOOP_KEY].close)

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_get("/info", _info)
    app.router.add_get("/kv/events", _kv_events)
    app.router.add_post("/prefill", _prefill)
    app.router.add_post("/decode", _decode)
    app.router.add_post("/generate", _generate)
    return app


async def _info(request: web.Request) -> web.Response:
    return web.Response(body=request.app[INFO_KEY].encode(), content_type=MSGPACK)


async def _kv_events(request: web.Request) -> web.Response:
    try:
        after = int(request.query["after"]) if "after" in request.query else None
    except ValueError:
        raise web.HTTPBadRequest(text="GET /kv/events[?after=<seq>]\n")
    kind, body = request.app[EVENTS_KEY].read(after)
    return web.Response(body=body, content_type=MSGPACK, headers={EVENTS_KIND_HEADER: kind})


def _event(req: Request, with_stats: bool, block_tokens: int = 0) -> TokenEvent:
    reason, text = req.finish_reason, req.shown_text
    if not with_stats:
        return TokenEvent(tuple(req.output_token_ids), text, req.finished, reason)
    return TokenEvent(tuple(req.output_token_ids), text, req.finished, reason,
                      req.num_local_hit_tokens, req.num_loaded_tokens, req.num_model_tokens,
                      _prompt_hashes(req, block_tokens))


def _prompt_hashes(req: Request, block_tokens: int) -> tuple[bytes, ...]:
    return tuple(bytes(h) for h in req.block_hashes[:req.num_prompt_tokens // block_tokens])


class Snapshots(asyncio.Queue):
    """A request's snapshots (or an exception) for its stream. Each TokenEvent is
    cumulative (every output token and the text so far), so one queued behind another is
    all a reader needs: it takes the other's place, the first (with the hit stats) kept. A
    stream whose reader stalled had queued one per step, each as long as the output so
    far: 580 MB in 30 s for one 12k-token request."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self._first: object = None

    def _put(self, item) -> None:
        q = self._queue
        if self._first is None:
            self._first = item
        elif (q and isinstance(item, TokenEvent) and isinstance(q[-1], TokenEvent)
              and q[-1] is not self._first):
            q[-1] = item
            return
        q.append(item)


async def _submit(request: web.Request, rid: str, prompt, params: SamplingParams, snapshot,
                  **kw) -> asyncio.Queue:
    """Submit to the engine loop; returns a queue of snapshots (or exceptions)."""
    loop, q = asyncio.get_running_loop(), Snapshots()

    def callback(req: Request | None, err: BaseException | None) -> None:
        item = err if err is not None else snapshot(req)  # snapshot on the engine thread
        loop.call_soon_threadsafe(q.put_nowait, item)

    request.app[LOOP_KEY].submit(rid, prompt, params, callback, **kw)
    return q


async def _generate_request(request: web.Request) -> GenerateRequest:
    """The body as a GenerateRequest (its sampling parameters checked); a 400 if it is not one."""
    try:
        return GenerateRequest.decode(await request.read())
    except MessageError as e:
        raise web.HTTPBadRequest(text=str(e)) from e


async def _prefill(request: web.Request) -> web.Response:
    g = await _generate_request(request)
    n = len(g.prompt_token_ids)
    try:  # with its own max_tokens, not the 1 it runs with here: a request no cache of this
        # size can finish was prefilled and its first token streamed, then refused by the
        # decode worker
        request.app[LOOP_KEY].engine.check_fits_cache(n, n, g.params)
    except InvalidRequestError as e:
        raise web.HTTPBadRequest(text=str(e)) from e
    q = await _submit(request, g.request_id, g.prompt_token_ids,
                      replace(g.params, max_tokens=1),
                      lambda r: _prefill_result(r, g.params, request.app[INFO_KEY].block_tokens))
    try:
        item = await q.get()
    except asyncio.CancelledError:
        request.app[LOOP_KEY].abort(g.request_id)
        raise
    if isinstance(item, BaseException):
        raise web.HTTPBadRequest(text=str(item))
    item = await _pool_holds_local_hits(request, item)
    return web.Response(body=item.encode(), content_type=MSGPACK)


async def _pool_holds_local_hits(request: web.Request, result: PrefillResult) -> PrefillResult:
    """The prompt blocks this prefill found in its own cache are in the pool too, for the
    decode worker to load: ones the pool has lost since are saved again from this cache,
    and the handoff names none past one that is in neither any more. A prefill that hit
    its own cache saved none of those blocks, and the decode worker waited BLOCK_WAIT_S
    (10 s) for them per request before computing them itself."""
    engine = request.app[LOOP_KEY].engine
    hits = result.block_hashes[:result.num_local_hit_tokens // request.app[INFO_KEY].block_tokens]
    if not hits or result.finished or engine.connector is None:
        return result
    held = await _pool_holds(engine.connector, hits)
    if held is None:  # the store is down: the decode worker does not wait on one seen down
        return result
    missing = [h for h, ok in zip(hits, held) if not ok]
    if not missing:
        return result
    queued = await asyncio.wrap_future(
        request.app[LOOP_KEY].call(lambda e: e.save_cached(missing)))
    if all(queued):
        return result
    lost = hits.index(missing[queued.index(False)])
    h = Handoff.decode(result.handoff)
    handoff = msgspec.structs.replace(h, block_hashes=h.block_hashes[:lost]).encode()
    return msgspec.structs.replace(result, handoff=handoff, block_hashes=hits[:lost])


def _prefill_result(req: Request, params: SamplingParams, block_tokens: int) -> PrefillResult:
    h = Handoff.of(req, params, block_tokens)
    # (req ran for one token: whether the request ends here is the handoff's to say)
    text = shown_text(req.text, params.stop, h.finish_reason is not None)
    return PrefillResult(h.encode(), h.first_token_id, text, h.finish_reason is not None,
                         h.finish_reason, req.num_local_hit_tokens, req.num_loaded_tokens, req.num_model_tokens,
                         h.block_hashes)


async def _stream(request: web.Request, rid: str, q: asyncio.Queue) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": MSGPACK})
    try:
        await resp.prepare(request)
        while True:
            item = await q.get()
            if isinstance(item, BaseException):
                await resp.write(frame(TokenEvent((), "", True, None, error=str(item))))
                break
            await resp.write(frame(item))
            if item.finished:
                break
    except asyncio.CancelledError:
        request.app[LOOP_KEY].abort(rid)
        raise
    except ConnectionError:  # the front end let go of the stream (its client left; or
        request.app[LOOP_KEY].abort(rid)  # "Connection lost" while a write waited):
    return resp  # aborted, nothing more to say (re-raised, aiohttp logged a 22-line
    # traceback per stream a client cancelled)


async def _decode(request: web.Request) -> web.StreamResponse:
    try:
        h = Handoff.decode(await request.read())
        gen = h.generator()
    except InvalidRequestError as e:
        raise web.HTTPBadRequest(text=f"bad handoff: {e}") from e
    await _blocks_committed(request.app[LOOP_KEY].engine, h.block_hashes)
    q = await _submit(request, h.request_id, h.prompt_token_ids, h.params,
                      _first_with_stats(request), output_token_ids=[h.first_token_id],
                      generator=gen)
    return await _stream(request, h.request_id, q)


async def _blocks_committed(engine, hashes: tuple[bytes, ...]) -> None:
    """Wait until the pool holds every block of a handoff: the prefill answered as soon as
    it sampled, while its last chunk's blocks were still being saved. Gives up after
    BLOCK_WAIT_S (the engine then recomputes what is missing: slower, never wrong)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BLOCK_WAIT_S
    while hashes and loop.time() < deadline:
        held = await _pool_holds(engine.connector, hashes)
        if held is None:  # a store outage: the engine falls back to recompute
            return
        missing = held.index(False) if False in held else len(held)
        hashes = hashes[missing:]  # a committed prefix stays committed: ask for the rest
        if hashes:
            await asyncio.sleep(BLOCK_POLL_S)


async def _pool_holds(connector, hashes) -> list[bool] | None:
    """Which of `hashes` the pool holds (contains_n, off the event loop), or None while its
    store is down or seen down: no client timeout is waited for per request then."""
    if connector.store_down:
        return None
    try:
        return await asyncio.get_running_loop().run_in_executor(
            None, connector.store.contains_n, list(hashes))
    except Exception:  # noqa: BLE001 - any failure of the store is an outage here
        return None


def _first_with_stats(request: web.Request):
    """A snapshot function whose first event carries the hit stats and prompt hashes."""
    first, bt = [True], request.app[INFO_KEY].block_tokens

    def snapshot(r: Request) -> TokenEvent:
        ev = _event(r, first[0], bt)
        first[0] = False
        return ev
    return snapshot


async def _generate(request: web.Request) -> web.StreamResponse:
    g = await _generate_request(request)
    q = await _submit(request, g.request_id, g.prompt_token_ids, g.params,
                      _first_with_stats(request))
    return await _stream(request, g.request_id, q)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a kvtier serving worker (started by kvtier cluster)")
    p.add_argument("--name", required=True)
    p.add_argument("--role", required=True, choices=[r.value for r in Role])
    p.add_argument("--port", type=int, default=0, help="default 0: one the kernel picks")
    p.add_argument("--port-file", help="write the bound port here before loading the model")
    p.add_argument("--store", dest="store_url")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false")
    a = p.parse_args(argv)
    lifetime.exit_with_parent()  # its launcher's end is its own (SIGTERM: flush, then exit)
    cfg = WorkerConfig(a.name, Role(a.role), a.port, store_url=a.store_url,
                       num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs,
                       chunk_tokens=a.chunk_tokens, threads=a.threads, calibrate=a.calibrate)
    sock = bind(cfg.host, cfg.port)
    if a.port_file:
        write_port_file(a.port_file, sock.getsockname()[1])
    engine = build_engine(cfg)
    calibration = calibrate(engine, cfg.name) if cfg.calibrate else None
    # SIGTERM / SIGINT: stop serving, flush pending saves (cleanup_ctx), exit 0.
    web.run_app(create_app(cfg, engine, calibration), sock=sock, print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
