"""The pool's store node in `kvtier cluster`: `kvtier serve` plus one read-only route that
hands the router the store's own KV events.

    python -m engine_adapter.serving.store_node [any `kvtier serve` flag]

Same flags, same application, same run loop as `kvtier serve` (this module only adds a
route to the app `kvtier serve` builds). The route:

    GET /kv/events?ns=<namespace id, hex>&after=<seq>     (auth as /stats)

relays `TieredStore.drain_events()` of that namespace: an `EventBatch` of the events after
`after`, or a `Snapshot` (`TieredStore.snapshot()`) when some are gone or `after` is
omitted; the `X-Kvtier-Events` header says which. A single-node daemon ships its events to
nobody (only to an etcd-elected leader in a multi-node pool), so without this the router
could only guess what the pool holds. Once `kvtier serve` offers such a route itself, this
module goes.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from aiohttp import web

from engine_adapter.serving.kv_events import KIND_HEADER, EventRing
from kvstore.cluster.messages import EventBatch, Snapshot

RINGS = web.AppKey("kv_event_rings", dict)
MSGPACK = "application/msgpack"


async def kv_events(request: web.Request) -> web.Response:
    from kvstore.daemon import app as daemon_app
    grant = daemon_app.grant_of(request)
    try:
        ns_id = int(request.query["ns"], 16)
        after = int(request.query["after"]) if "after" in request.query else None
    except (KeyError, ValueError):
        raise web.HTTPBadRequest(text="GET /kv/events?ns=<namespace id in hex>[&after=<seq>]\n")
    hosted = request.app[daemon_app.REGISTRY].find(ns_id, grant)
    if hosted is None:  # not opened yet: no worker has connected; nothing stored
        return _reply("snapshot", Snapshot("", ns_id, -1, {}).encode())
    ring = request.app[RINGS].setdefault(ns_id, EventRing())
    store = hosted.store
    ring.extend(store.drain_events())
    events = None if after is None else ring.after(after)
    if events is not None:
        return _reply("events", EventBatch(store.config.node_id, ns_id, events).encode())
    seq, blocks = await asyncio.get_running_loop().run_in_executor(None, store.snapshot)
    ring.reset(seq + 1)
    return _reply("snapshot", Snapshot(store.config.node_id, ns_id, seq, blocks).encode())


def _reply(kind: str, body: bytes) -> web.Response:
    return web.Response(body=body, content_type=MSGPACK, headers={KIND_HEADER: kind})


def with_event_route(app: web.Application) -> web.Application:
    app[RINGS] = {}
    app.router.add_get("/kv/events", kv_events)
    return app


def main(argv: list[str] | None = None) -> int:
    from kvstore.daemon import app as daemon_app
    from kvstore.daemon.serve import configure, run

    p = argparse.ArgumentParser(description="kvtier serve, plus GET /kv/events for the "
                                "router of kvtier cluster")
    configure(p)
    args = p.parse_args(argv)
    build = daemon_app.create_app
    daemon_app.create_app = lambda cfg: with_event_route(build(cfg))  # what serve() calls
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
