"""A worker process: one engine behind a tiny aiohttp server on a loopback port.

    python -m engine_adapter.serving.worker --role prefill --name prefill-0 --port 9001 \
        --store kvtier://127.0.0.1:7481

Routes: GET /info (WorkerInfo), POST /prefill (GenerateRequest -> PrefillResult, role
prefill), POST /decode (Handoff bytes -> TokenEvent frames, role decode), POST /generate
(GenerateRequest -> TokenEvent frames, role colocated). Bodies are msgpack
(`serving.protocol`). A client that disconnects aborts its request.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass, replace

import torch
from aiohttp import web

from engine_adapter.config import EngineConfig
from engine_adapter.errors import InvalidRequestError
from engine_adapter.request import FinishReason, Request
from engine_adapter.sampling import SamplingParams
from engine_adapter.serving.engine_loop import EngineLoop
from engine_adapter.serving.protocol import (MSGPACK, GenerateRequest, PrefillResult, ProtocolError,
                                             Role, TokenEvent, WorkerInfo, frame, pack, unpack)
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
    threads: int = 1
    
    def __post_init__(self) -> None:
        if self.role is not Role.COLOCATED and not self.store_url:
            raise ValueError(f"a {self.role.value} worker needs --store (the pool's kvtier:// URL)")


LOOP_KEY = web.AppKey("loop", EngineLoop)
INFO_KEY = web.AppKey("info", WorkerInfo)


def build_engine(cfg: WorkerConfig):
    from engine_adapter.engine import LLMEngine
    from engine_adapter.serving.model_cache import load_cached
    from kvstore.keys import Namespace

    torch.set_num_threads(cfg.threads)
    model, tokenizer = load_cached()
    ecfg = EngineConfig(num_blocks=cfg.num_blocks, max_num_seqs=cfg.max_num_seqs)
    store = None
    if cfg.store_url:
        from kvstore.client import Client
        mc = model.config
        ns = Namespace(mc.name, mc.num_layers, mc.num_kv_heads, mc.head_dim, ecfg.dtype,
                       ecfg.block_tokens, tenant=ecfg.tenant)
        store = Client(cfg.store_url, namespace=ns)
    return LLMEngine(model, ecfg, tokenizer=tokenizer, store=store)


def create_app(cfg: WorkerConfig, engine) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    ns = engine.ns
    app[INFO_KEY] = WorkerInfo(cfg.name, cfg.role.value, engine.model.config.name, os.getpid(),
                               engine.config.num_blocks, engine.config.block_tokens,
                               engine.max_model_len,
                               (ns.model, ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.dtype,
                                ns.block_tokens, ns.revision, ns.tenant))

    async def engine_ctx(app: web.Application):
        app[LOOP_KEY] = EngineLoop(engine, flush_on_finish=cfg.role is Role.PREFILL)
        yield
        await asyncio.get_running_loop().run_in_executor(None, app[LOOP_KEY].close)

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_get("/info", _info)
    app.router.add_post("/prefill", _prefill)
    app.router.add_post("/decode", _decode)
    app.router.add_post("/generate", _generate)
    return app


async def _info(request: web.Request) -> web.Response:
    return web.Response(body=pack(request.app[INFO_KEY]), content_type=MSGPACK)


def _event(req: Request, with_stats: bool, block_tokens: int = 0) -> TokenEvent:
    reason = None if req.finish_reason is None else req.finish_reason.value
    if not with_stats:
        return TokenEvent(tuple(req.output_token_ids), req.text, req.finished, reason)
    return TokenEvent(tuple(req.output_token_ids), req.text, req.finished, reason,
                      req.num_local_hit_tokens, req.num_loaded_tokens, req.num_model_tokens,
                      _prompt_hashes(req, block_tokens))


def _prompt_hashes(req: Request, block_tokens: int) -> tuple[bytes, ...]:
    return tuple(bytes(h) for h in req.block_hashes[:req.num_prompt_tokens // block_tokens])


async def _submit(request: web.Request, rid: str, prompt, params: SamplingParams, snapshot,
                  **kw) -> asyncio.Queue:
    """Submit to the engine loop; returns a queue of snapshots (or exceptions)."""
    loop, q = asyncio.get_running_loop(), asyncio.Queue()

    def callback(req: Request | None, err: BaseException | None) -> None:
        item = err if err is not None else snapshot(req)  # snapshot on the engine thread
        loop.call_soon_threadsafe(q.put_nowait, item)

    request.app[LOOP_KEY].submit(rid, prompt, params, callback, **kw)
    return q


async def _body(request: web.Request, cls):
    try:
        return unpack(cls, await request.read())
    except ProtocolError as e:
        raise web.HTTPBadRequest(text=str(e)) from e


async def _generate_body(request: web.Request) -> tuple[GenerateRequest, SamplingParams]:
    """The request and its sampling parameters; a 400 for bad parameters."""
    g: GenerateRequest = await _body(request, GenerateRequest)
    try:
        return g, SamplingParams.from_dict(g.params)
    except InvalidRequestError as e:
        raise web.HTTPBadRequest(text=str(e)) from e


async def _prefill(request: web.Request) -> web.Response:
    g, params = await _generate_body(request)
    q = await _submit(request, g.request_id, g.prompt_token_ids,
                      replace(params, max_tokens=1),
                      lambda r: _prefill_result(r, params, request.app[INFO_KEY].block_tokens))
    try:
        item = await q.get()
    except asyncio.CancelledError:
        request.app[LOOP_KEY].abort(g.request_id)
        raise
    if isinstance(item, BaseException):
        raise web.HTTPBadRequest(text=str(item))
    return web.Response(body=pack(item), content_type=MSGPACK)


def _prefill_result(req: Request, params: SamplingParams, block_tokens: int) -> PrefillResult:
    reason = req.finish_reason
    if reason is FinishReason.LENGTH and params.max_tokens > 1:
        reason = None  # only our max_tokens=1 ended it: decoding continues
    gen = None if req.generator is None else bytes(req.generator.get_state().numpy().tobytes())
    hashes = _prompt_hashes(req, block_tokens)
    handoff = Handoff(req.request_id, tuple(req.token_ids[:req.num_prompt_tokens]),
                      req.output_token_ids[0], params, gen, hashes, reason)
    return PrefillResult(handoff.to_bytes(), handoff.first_token_id, req.text, reason is not None,
                         None if reason is None else reason.value, req.num_local_hit_tokens,
                         req.num_loaded_tokens, req.num_model_tokens, hashes)


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
    except (asyncio.CancelledError, ConnectionResetError):
        request.app[LOOP_KEY].abort(rid)
        raise
    return resp


async def _decode(request: web.Request) -> web.StreamResponse:
    try:
        h = Handoff.from_bytes(await request.read())
    except (InvalidRequestError, ValueError, TypeError) as e:
        raise web.HTTPBadRequest(text=f"bad handoff: {e}") from e
    gen = None
    if h.generator_state is not None:
        gen = torch.Generator()
        gen.set_state(torch.frombuffer(bytearray(h.generator_state), dtype=torch.uint8))
    q = await _submit(request, h.request_id, h.prompt_token_ids, h.params,
                      lambda r: _event(r, False), output_token_ids=[h.first_token_id],
                      generator=gen)
    return await _stream(request, h.request_id, q)


async def _generate(request: web.Request) -> web.StreamResponse:
    g, params = await _generate_body(request)
    first, bt = [True], request.app[INFO_KEY].block_tokens

    def snapshot(r: Request) -> TokenEvent:
        ev = _event(r, first[0], bt)  # hit stats and hashes ride on the first event
        first[0] = False
        return ev

    q = await _submit(request, g.request_id, g.prompt_token_ids, params, snapshot)
    return await _stream(request, g.request_id, q)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a kvtier serving worker (started by kvtier cluster)")
    p.add_argument("--name", required=True)
    p.add_argument("--role", required=True, choices=[r.value for r in Role])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--store", dest="store_url")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    cfg = WorkerConfig(a.name, Role(a.role), a.port, store_url=a.store_url,
                       num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs, threads=a.threads)
    engine = build_engine(cfg)
    # SIGTERM / SIGINT: stop serving, flush pending saves (cleanup_ctx), exit 0.
    web.run_app(create_app(cfg, engine), host=cfg.host, port=cfg.port, print=None,
                handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
