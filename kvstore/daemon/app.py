"""The control plane: `create_app(cfg)` builds the aiohttp application that owns the daemon.

Resources live in `cleanup_ctx` (set up in order, torn down in reverse): the data-plane
listening socket, the namespace registry (stores), then the data-plane threads. So on
shutdown the data plane stops first (in-flight ops finish), then every store closes with
flush. Slow store work runs in the default executor, never on the event loop.

Endpoints: /healthz (no auth), /stats, /metrics, /kv/events, /admin/namespaces,
/admin/quotas, POST /admin/namespaces/{ns_id}/clear. With tokens configured every endpoint but /healthz
needs `Authorization: Bearer TOKEN`; a tenant token sees only its tenant's namespaces, and
/metrics and /admin/quotas need an admin token.
"""
from __future__ import annotations

import asyncio
import gc
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.cluster.messages import EVENTS_KIND_HEADER, EventBatch, Snapshot
from kvstore.daemon import cluster, views
from kvstore.daemon.access import (CLEARS, CONFIG, DATA_SOCKET, DATAPLANE, METRICS, REGISTRY,
                                   grant_of, require_admin)
from kvstore.daemon.config import ADMIN, DaemonConfig
from kvstore.daemon.dataplane import DataPlane, listen, listen_local
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.namespaces import Hosted, Registry

MAX_CLEARS = 64  # namespace clears waiting at once (each for its namespace's requests to end)

async def _listen_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    app[DATA_SOCKET] = listen(cfg.host, cfg.port)
    yield
    app[DATA_SOCKET].close()


async def _registry_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    registry = app[REGISTRY] = Registry(cfg)
    app[METRICS] = Metrics(registry.hosted)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, registry.reopen_existing)
    app[METRICS].namespaces_failed.set(len(registry.failed))
    clears = app[CLEARS] = ThreadPoolExecutor(MAX_CLEARS, thread_name_prefix="kvtier-clear")
    yield
    clears.shutdown(wait=False)
    await loop.run_in_executor(None, registry.close)


async def _dataplane_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    local = listen_local() if cfg.local_socket else None
    plane = app[DATAPLANE] = DataPlane(cfg, app[REGISTRY], app[METRICS], app[DATA_SOCKET],
                                       local)
    plane.start()
    yield
    await asyncio.get_running_loop().run_in_executor(None, plane.shutdown, cfg.shutdown_grace_s)


async def healthz(request: web.Request) -> web.Response:
    """200 while the data plane accepts connections; 503 (with why) when it does not."""
    app = request.app
    plane = app[DATAPLANE]
    body = {"status": "ok" if plane.accepting else "not accepting",
            "node_id": app[CONFIG].node_id, "data_port": plane.port,
            "namespaces_failed": len(app[REGISTRY].failed)}
    return web.json_response(body, status=200 if plane.accepting else 503)


async def stats(request: web.Request) -> web.Response:
    hosted = request.app[REGISTRY].hosted(grant_of(request))
    rows = await asyncio.get_running_loop().run_in_executor(None, views.stats_rows, hosted)
    body = {"node_id": request.app[CONFIG].node_id, "namespaces": rows}
    if grant_of(request) == ADMIN:
        body["namespaces_failed"] = request.app[REGISTRY].failed
        # the start's objects are frozen out of the cyclic GC (kvstore.daemon.serve); the
        # collections since, per generation, say whether runtime garbage still costs pauses
        body["process"] = {"gc_frozen_objects": gc.get_freeze_count(),
                           "gc_collections": [g["collections"] for g in gc.get_stats()]}
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    require_admin(request)
    body = await asyncio.get_running_loop().run_in_executor(
        None, generate_latest, request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def namespaces(request: web.Request) -> web.Response:
    hosted = request.app[REGISTRY].hosted(grant_of(request))
    return web.json_response({"namespaces": [views.namespace_row(h) for h in hosted]})


async def quotas(request: web.Request) -> web.Response:
    require_admin(request)
    cfg = request.app[CONFIG]
    return web.json_response({"default_blocks": cfg.quota_blocks,
                              "tenants": dict(cfg.tenant_quotas)})


async def clear(request: web.Request) -> web.Response:
    grant = grant_of(request)
    try:
        ns_id = int(request.match_info["ns_id"], 16)
    except ValueError:
        raise web.HTTPBadRequest(text="ns_id is the namespace id in hex (see /admin/namespaces)\n")
    registry = request.app[REGISTRY]
    hosted: Hosted | None = registry.find(ns_id, grant)
    if hosted is None:
        raise web.HTTPNotFound(text=f"no namespace {ns_id:016x} visible to this token\n")
    # (in threads of its own: a clear waits for the namespace's requests to end, a stuck PUT's
    # by its deadline, minutes at worst; in the default executor, a tenant clearing six of
    # its namespaces, each with a PUT whose payload never came, took every thread /stats,
    # /metrics and the cluster's snapshots run in, and they went unanswered)
    await asyncio.get_running_loop().run_in_executor(request.app[CLEARS], registry.clear, hosted)
    return web.json_response({"cleared": f"{ns_id:016x}"})


async def kv_events(request: web.Request) -> web.Response:
    """GET /kv/events?ns=<namespace id, hex>[&after=<seq>]: a namespace's KV events after
    `after` (an EventBatch), or, when some are gone or `after` is omitted, its content (a
    Snapshot); the EVENTS_KIND_HEADER says which. What a router outside the cluster (the
    one of `kvtier cluster`) follows to know what this node holds. Visible as /stats is."""
    grant = grant_of(request)
    try:
        ns_id = int(request.query["ns"], 16)
        after = int(request.query["after"]) if "after" in request.query else None
        if not 0 <= ns_id < 1 << 64 or (after is not None and not -1 <= after < 1 << 63):
            raise ValueError("out of range")
    except (KeyError, ValueError):
        raise web.HTTPBadRequest(text="GET /kv/events?ns=<namespace id: 16 hex digits at most>"
                                 "[&after=<seq: -1 or more, under 2**63>]\n")
    node = request.app[CONFIG].node_id
    hosted: Hosted | None = request.app[REGISTRY].find(ns_id, grant)
    if hosted is None:  # not opened (or not this token's): nothing stored
        return _events_reply("snapshot", Snapshot(node, ns_id, -1, {}).encode())
    events = None if after is None else hosted.events_after(after)
    if events is not None:
        return _events_reply("events", EventBatch(node, ns_id, events).encode())
    seq, blocks = await asyncio.get_running_loop().run_in_executor(None, hosted.snapshot)
    return _events_reply("snapshot", Snapshot(node, ns_id, seq, blocks).encode())


def _events_reply(kind: str, body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/msgpack",
                        headers={EVENTS_KIND_HEADER: kind})


def create_app(cfg: DaemonConfig) -> web.Application:
    app = web.Application(client_max_size=cluster.MAX_CONTROL_BODY)
    app[CONFIG] = cfg
    app.cleanup_ctx.extend([_listen_ctx, _registry_ctx, _dataplane_ctx])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv/events", kv_events)
    app.router.add_get("/admin/namespaces", namespaces)
    app.router.add_get("/admin/quotas", quotas)
    app.router.add_post("/admin/namespaces/{ns_id}/clear", clear)
    cluster.add_routes(app)
    return app
