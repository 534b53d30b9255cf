"""The OpenAI-compatible front end (aiohttp): /v1/models, /v1/completions,
/v1/chat/completions (SSE streaming or not), /metrics, /healthz, /cluster (workers, the
fitted cost model, the block index per node) and /cluster/locate (which nodes hold a
prompt's prefix, as the router's KV-event-fed index has it).

    app = create_app(FrontendConfig(model="..."), router)   # router: serving.router.Router

A request is tokenized here (the router needs its block hashes to place it), then either
prefilled on a prefill worker (which returns the first token and publishes the prompt's
blocks to the pool) and decoded on a decode worker, or, colocated, run on one worker.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, NamedTuple

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from engine_adapter.request import FinishReason
from engine_adapter.sampling import SamplingParams
from engine_adapter.serving import openai_api as api
from engine_adapter.serving.protocol import GenerateRequest, Role
from engine_adapter.serving.router import (NoWorkerError, Router, WorkerDiedError,
                                           WorkerRejectedError)
from kvstore.daemon import httpguard
from kvstore.tuning import raise_open_file_limit

log = logging.getLogger("kvtier.frontend")


@dataclass(frozen=True)
class FrontendConfig:
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    startup_timeout_s: float = 600.0
    max_connections: int = 1024  # open at once (`serve`): streams in flight count too
    header_deadline_s: float = httpguard.HEADER_DEADLINE_S


class Progress(NamedTuple):
    text: str               # cumulative output text
    num_tokens: int         # output tokens so far
    finish_reason: str | None
    cached_tokens: int
    num_prompt_tokens: int


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvtier_requests", "requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("kvtier_ttft_seconds", "time to first token", registry=r,
                              buckets=(.05, .1, .25, .5, 1, 2, 4, 8, 16, 32, 64))
        self.tpot = Histogram("kvtier_tpot_seconds", "time per output token after the first",
                              registry=r, buckets=(.01, .025, .05, .1, .2, .4, .8, 1.6))
        self.prompt_tokens = Counter("kvtier_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter("kvtier_cached_prompt_tokens", "prompt tokens whose KV came "
                                     "from a cache", ["source"], registry=r)
        self.computed_tokens = Counter("kvtier_computed_prompt_tokens", "prompt tokens the "
                                       "prefill computed", registry=r)
        self.decode_loaded_tokens = Counter("kvtier_decode_loaded_tokens", "prompt tokens "
                                            "decode workers loaded from the pool instead of "
                                            "recomputing them after a handoff", registry=r)
        self.output_tokens = Counter("kvtier_generation_tokens", "output tokens", registry=r)
        self.worker_up = Gauge("kvtier_worker_up", "1 while a worker is alive", ["worker", "role"],
                               registry=r)


ROUTER_KEY = web.AppKey("router", Router)
CFG_KEY = web.AppKey("cfg", FrontendConfig)
METRICS_KEY = web.AppKey("metrics", Metrics)
TOKENIZER_KEY = web.AppKey("tokenizer", object)
NS_KEY = web.AppKey("ns", object)


def create_app(cfg: FrontendConfig, router: Router, tokenizer: Any = None) -> web.Application:
    app = web.Application()
    app[CFG_KEY], app[ROUTER_KEY], app[METRICS_KEY] = cfg, router, Metrics()

    async def cluster_ctx(app: web.Application):
        loop = asyncio.get_running_loop()
        tok = loop.run_in_executor(None, _load_tokenizer) if tokenizer is None else None
        await router.start(cfg.startup_timeout_s)
        app[TOKENIZER_KEY] = tokenizer if tok is None else await tok
        app[NS_KEY] = router.workers[0].info.ns
        watch = asyncio.create_task(router.watch())
        yield
        watch.cancel()
        await router.close()

    app.cleanup_ctx.append(cluster_ctx)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/cluster", _cluster)
    app.router.add_post("/cluster/locate", _locate)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", lambda r: _serve(r, chat=False))
    app.router.add_post("/v1/chat/completions", lambda r: _serve(r, chat=True))
    return app


def serve(app: web.Application, sock: socket.socket,
          ready: Callable[[], None] = lambda: None) -> None:
    """Serve `app` (create_app's) on a bound socket until SIGINT or SIGTERM (`ready()` once
    it listens, after every worker is up), behind
    httpguard: at most `max_connections` open at once (an idle one makes room for a new
    one), each connection's first request head whole within `header_deadline_s`, an idle
    kept-alive one closed after httpguard.KEEPALIVE_S. aiohttp's `run_app` has none of
    these: 1,000 connections that sent half a head, or none, held their descriptors for
    good, and with them the front end's sockets to the workers."""
    asyncio.run(_listen(app, sock, ready))


async def _listen(app: web.Application, sock: socket.socket,
                  ready: Callable[[], None]) -> None:
    cfg = app[CFG_KEY]
    raise_open_file_limit()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gate = httpguard.Gate(limit=cfg.max_connections, deadline_s=cfg.header_deadline_s)
    app.middlewares.append(gate.middleware)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           keepalive_timeout=httpguard.KEEPALIVE_S)
    setup = asyncio.ensure_future(runner.setup())  # (waits for every worker: a stop
    stopped = asyncio.ensure_future(stop.wait())  # meanwhile ends it)
    try:
        await asyncio.wait((setup, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not setup.done():
            setup.cancel()
            await asyncio.gather(setup, return_exceptions=True)
        if setup.cancelled() or setup.exception() is not None:
            await app[ROUTER_KEY].close()  # (what its start opened: the cleanup never runs)
        if setup.cancelled():
            return
        setup.result()
        server = await httpguard.serve_on(runner.server, sock, gate)
        ready()
        await stopped
        server.close()
    finally:
        stopped.cancel()
        if setup.done() and not setup.cancelled() and setup.exception() is None:
            await runner.cleanup()


def _load_tokenizer():
    from engine_adapter.serving.model_cache import load_tokenizer
    return load_tokenizer()


async def _healthz(request: web.Request) -> web.Response:
    """ok: a request can be served (a live colocated worker, or a live prefill and a live
    decode worker); 503 otherwise, so that a load balancer stops sending here. It said ok
    with a prefill worker alone, which could serve nothing."""
    router = request.app[ROUTER_KEY]
    live = [w for w in router.workers if w.alive and w.responsive]
    roles = {w.role for w in live}
    ok = Role.COLOCATED in roles or {Role.PREFILL, Role.DECODE} <= roles
    return web.json_response({"ok": ok, "live_workers": [w.name for w in live]},
                             status=200 if ok else 503)


async def _cluster(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    return web.json_response({"pooled": router.pooled, "policy": router.policy_kind.value,
                              "cost_model": router.cost_summary(),
                              "workers": [{"name": w.name, "role": w.role.value, "pid": w.pid,
                                           "url": w.url, "alive": w.alive,
                                           "responsive": w.responsive, "inflight": w.inflight}
                                          for w in router.workers],
                              "index": _index_summary(router.index)})


def _index_summary(index) -> dict:
    """Per node of the router's block index: blocks by tier, and whether it is stale."""
    from kvstore.events import TierKind
    return {n: {"stale": index.is_stale(n), **{t.name.lower(): len(index.blocks_of(n, t))
                                              for t in TierKind if index.blocks_of(n, t)}}
            for n in index.node_ids()}


async def _locate(request: web.Request) -> web.Response:
    """Where the router believes a prompt's prefix is cached: {"prompt": "..." or [ids]}
    -> {"blocks": full blocks of the prompt, "nodes": {node: leading blocks it holds}}."""
    try:
        body = await _body(request)
        req = api.parse(body, bool(body.get("messages")), request.app[CFG_KEY].model)
        hashes = await _off_loop(_prompt_hashes, request.app, req)
    except TimeoutError:
        return _error(408, _LATE_BODY, "invalid_request_error")
    except (ValueError, TypeError, OverflowError, api.BadRequest, AttributeError) as e:
        # (bytes not UTF-8, max_tokens "x", token ids past int32: each was a 500)
        return _error(400, f"POST a completions or chat body: {e}", "invalid_request_error")
    match = request.app[ROUTER_KEY].index.query(hashes)
    return web.json_response({"blocks": len(hashes),
                              "nodes": {n: match.length(n) for n in match.nodes()}})


async def _metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS_KEY]
    for w in request.app[ROUTER_KEY].workers:
        m.worker_up.labels(w.name, w.role.value).set(1 if w.alive and w.responsive else 0)
    return web.Response(body=generate_latest(m.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _models(request: web.Request) -> web.Response:
    model = request.app[CFG_KEY].model
    return web.json_response({"object": "list", "data": [
        {"id": model, "object": "model", "created": 0, "owned_by": "kvtier"}]})


BODY_DEADLINE_S = 30.0
_LATE_BODY = f"the request body did not arrive whole within {BODY_DEADLINE_S:.0f} s"


async def _body(request: web.Request):
    """The request's JSON body, whole within BODY_DEADLINE_S (TimeoutError past it): a
    client that announced a length and sent nothing held its connection for good."""
    async with asyncio.timeout(BODY_DEADLINE_S):
        return await request.json()


# one thread: one tokenizer is not used by two threads at once (a fast tokenizer's Rust
# side refuses a borrow that is already taken), and one long prompt is all it costs
_PROMPT_THREAD = ThreadPoolExecutor(1, thread_name_prefix="kvtier-tokenize")


async def _off_loop(fn, *args):
    """`fn(*args)` off the event loop: tokenizing (a chat template over 20k messages, a 1 MB
    prompt) and hashing a long prompt took 1-1.7 s on it, and every stream of the front end
    stood still meanwhile (/healthz answered in 1.5 s)."""
    return await asyncio.get_running_loop().run_in_executor(_PROMPT_THREAD, fn, *args)


def _prompt_hashes(app: web.Application, req: api.ApiRequest) -> tuple[bytes, ...]:
    return _hashes(app, _tokenize(app, req))


def _tokenize(app: web.Application, req: api.ApiRequest) -> list[int]:
    tok = app[TOKENIZER_KEY]
    if req.chat:
        text = tok.apply_chat_template(req.prompt, tokenize=False, add_generation_prompt=True)
        return list(tok(text)["input_ids"])
    if isinstance(req.prompt, str):
        return list(tok(req.prompt)["input_ids"])
    return list(req.prompt)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    app, m = request.app, request.app[METRICS_KEY]
    try:
        body = await _body(request)
    except TimeoutError:
        return _error(408, _LATE_BODY, "invalid_request_error")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (it was a 500)
        return _error(400, f"the body is not JSON in UTF-8: {e}", "invalid_request_error")
    try:
        req = api.parse(body, chat, app[CFG_KEY].model)
        params = SamplingParams.from_dict(req.params)
        ids = await _off_loop(_tokenize, app, req)
        if not ids:
            raise api.BadRequest("the prompt is empty")
        hashes = await _off_loop(_hashes, app, ids)
    except (api.BadRequest, ValueError, TypeError, OverflowError) as e:  # InvalidRequestError
        # is a ValueError; int(1e999) an OverflowError
        m.requests.labels("invalid").inc()
        return _error(400, str(e), "invalid_request_error")
    rid = f"cmpl-{uuid.uuid4().hex[:16]}"
    try:
        pw, dw, _, est = app[ROUTER_KEY].place(hashes, len(ids), params.max_tokens)
    except NoWorkerError as e:
        m.requests.labels("unavailable").inc()
        return _error(503, str(e), "service_unavailable")
    headers = {"X-Kvtier-Prefill-Worker": pw.name, "X-Kvtier-Decode-Worker": dw.name}
    gen = _generate(app, rid, ids, params, pw, dw, est)
    try:
        if req.stream:
            return await _stream(request, req, rid, gen, headers)
        return await _unary(request, req, rid, gen, headers, m)
    finally:
        # (a client that went away left the generator suspended: the worker generated on
        # to max_tokens for nobody, and the router counted the request in flight until a
        # garbage collection happened to close it)
        await gen.aclose()


def _hashes(app: web.Application, ids: list[int]) -> tuple[bytes, ...]:
    from kvstore.keys import hash_blocks
    ns = app[NS_KEY]
    full = len(ids) // ns.block_tokens * ns.block_tokens
    return tuple(bytes(h) for h in hash_blocks(ns, ids[:full]))


class _Booking:
    """The work a request books on its prefill worker (what the router sees as that
    worker's backlog): its prefill until the first token, then, on a colocated worker, its
    decode until the last."""

    def __init__(self, w, est) -> None:
        self.w, self.decode_s = w, est.decode_s
        w.booked[self] = est.prefill_s + est.decode_s

    def prefilled(self) -> None:
        if self in self.w.booked:
            self.w.booked[self] = self.decode_s

    def done(self) -> None:
        self.w.booked.pop(self, None)


async def _first(router, pw, dw, g: GenerateRequest, m: Metrics):
    """(first event, the rest of the stream or None, cached prompt tokens)."""
    if pw.role is Role.COLOCATED:
        events = router.stream(pw, "/generate", g.encode())
        first = await events.__anext__()
        local, loaded = first.num_local_hit_tokens, first.num_loaded_tokens
    else:
        res = await router.prefill(pw, g)
        local, loaded = res.num_local_hit_tokens, res.num_loaded_tokens
        first = _FirstEvent((res.first_token_id,), res.first_text, res.finished,
                            res.finish_reason)
        events = None if res.finished else router.stream(dw, "/decode", res.handoff)
    _count_prompt(m, len(g.prompt_token_ids), local, loaded)
    return first, events, local + loaded


async def _generate(app: web.Application, rid: str, ids: list[int], params: SamplingParams,
                    pw, dw, est) -> AsyncIterator[Progress]:
    """Progress of one request, recording its metrics; raises the router's errors."""
    router, m = app[ROUTER_KEY], app[METRICS_KEY]
    start, n_prompt, booking = time.perf_counter(), len(ids), _Booking(pw, est)
    events = rest = None
    for w in {pw, dw}:
        w.inflight += 1
    try:
        g = GenerateRequest(rid, tuple(ids), params)
        first, events, cached = await _first(router, pw, dw, g, m)
        booking.prefilled()
        first_at = time.perf_counter()
        m.ttft.observe(first_at - start)
        last = Progress(first.text, len(first.token_ids), _reason(first.finish_reason), cached,
                        n_prompt)
        yield last
        if events is not None and not first.finished:
            rest = _rest(dw, events, n_prompt + params.max_tokens, cached, n_prompt, m)
            async for last in rest:
                yield last
        if last.num_tokens > 1:
            m.tpot.observe((time.perf_counter() - first_at) / (last.num_tokens - 1))
        m.output_tokens.inc(last.num_tokens)
        m.requests.labels("ok").inc()
    except Exception as e:
        m.requests.labels({WorkerDiedError: "worker_failed", WorkerRejectedError: "invalid"}
                          .get(type(e), "error")).inc()
        raise
    finally:
        booking.done()
        for w in {pw, dw}:
            w.inflight -= 1
        # closed, not left to the garbage collector: the worker's stream ends now (its
        # connection closed: the worker aborts the request), and its load with it
        for gen in (rest, events):
            if gen is not None:
                await gen.aclose()


async def _rest(dw, events, kv_tokens: int, cached: int, n_prompt: int,
                m: Metrics) -> AsyncIterator[Progress]:
    """The stream after the first token, counted in the decode worker's load."""
    dw.streams += 1
    dw.kv_tokens += kv_tokens
    try:
        async for ev in events:
            if dw.role is Role.DECODE:  # stats ride on a decode stream's first event only
                m.decode_loaded_tokens.inc(ev.num_loaded_tokens)
            yield Progress(ev.text, len(ev.token_ids), _reason(ev.finish_reason), cached,
                           n_prompt)
    finally:
        dw.streams -= 1
        dw.kv_tokens -= kv_tokens


class _FirstEvent(NamedTuple):
    """The prefill worker's first token, shaped like the TokenEvent a colocated worker sends."""

    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: FinishReason | None


def _reason(reason: FinishReason | None) -> str | None:
    """The OpenAI finish_reason string ("stop", "length") of a worker's FinishReason."""
    return None if reason is None else reason.value


def _count_prompt(m: Metrics, n_prompt: int, local: int, loaded: int) -> None:
    m.prompt_tokens.inc(n_prompt)
    m.cached_tokens.labels("local").inc(local)
    m.cached_tokens.labels("pool").inc(loaded)
    m.computed_tokens.inc(n_prompt - local - loaded)


async def _unary(request: web.Request, req: api.ApiRequest, rid: str,
                 gen: AsyncIterator[Progress], headers: dict, m: Metrics) -> web.Response:
    last = None
    try:
        async for last in gen:
            if _gone(request):
                return web.Response(status=499)  # (nobody reads it: the request ends here)
    except Exception as e:
        return _failed(rid, e)
    usage = api.Usage(last.num_prompt_tokens, last.num_tokens, last.cached_tokens)
    return web.json_response(api.response(req, rid, last.text, last.finish_reason, usage),
                             headers=headers)


async def _stream(request: web.Request, req: api.ApiRequest, rid: str,
                  gen: AsyncIterator[Progress], headers: dict) -> web.StreamResponse:
    # the stream opens with its first token: a request the workers refuse before that (one
    # that cannot fit their caches, say) is a plain 400 / 503, as unary, not an error event
    # in a 200 stream
    try:
        head = [await gen.__anext__()]
    except StopAsyncIteration:
        head = []
    except Exception as e:
        return _failed(rid, e)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **headers})
    sent, last, first = "", None, True
    try:
        await resp.prepare(request)
        async for last in _chain(head, gen):
            delta = last.text[len(sent):] if last.text.startswith(sent) else ""
            sent = last.text if last.text.startswith(sent) else sent
            await resp.write(api.sse(api.chunk(req, rid, delta, last.finish_reason, first)))
            first = False
        if req.include_usage and last is not None:
            usage = api.Usage(last.num_prompt_tokens, last.num_tokens, last.cached_tokens)
            await resp.write(api.sse(api.usage_chunk(req, rid, usage)))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionError:  # the client went away (reset, or "Connection lost" while a
        pass  # write waited): its request ends with this handler (_serve closes the
        # generator; the worker aborts the request)
    except WorkerRejectedError as e:
        await _last_event(resp, api.error_body(str(e), "invalid_request_error", 400))
    except WorkerDiedError as e:
        await _last_event(resp, api.error_body(str(e), "worker_failed", 503))
    except Exception as e:  # the stream is open: end it with an error event, not a cut
        log.exception("request %s failed", rid)
        await _last_event(resp, api.error_body(f"internal error: {e}", "internal_error", 500))
    return resp


def _failed(rid: str, e: Exception) -> web.Response:
    """The answer to a request that failed before anything of it was sent."""
    if isinstance(e, WorkerRejectedError):
        return _error(400, str(e), "invalid_request_error")
    if isinstance(e, WorkerDiedError):
        return _error(503, str(e), "worker_failed")
    log.error("request %s failed", rid, exc_info=e)
    return _error(500, f"internal error: {e}", "internal_error")


async def _chain(head: list[Progress], gen: AsyncIterator[Progress]) -> AsyncIterator[Progress]:
    for item in head:
        yield item
    async for item in gen:
        yield item


async def _last_event(resp: web.StreamResponse, body: dict) -> None:
    try:
        await resp.write(api.sse(body))
    except ConnectionError:
        pass  # the client is gone too: nothing to tell


def _gone(request: web.Request) -> bool:
    """Has the client closed its connection (a unary request's: nothing is written to it
    until the answer is whole)?"""
    transport = request.transport
    return transport is None or transport.is_closing()


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(api.error_body(message, kind, status), status=status)
