"""Feeds the router's `ClusterIndex` with the KV events of the workers and the store node.

Every source answers `GET <url>?after=SEQ` with its events numbered after SEQ (an
`EventBatch`) or, when those are gone or asked without `after`, a `Snapshot` (see
`serving.kv_events`). The feed polls each source every `interval_s`: first for a snapshot,
then for the events after the last one the index applied. Events apply in seq order; a gap
the index cannot close marks the node stale (its blocks drop out of every query) and the
next poll asks that node for a snapshot. A source that fails is retried next round; a
source removed (its worker died) leaves the index with its blocks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

import aiohttp

from kvstore.cluster.messages import EVENTS_KIND_HEADER
from kvstore.cluster.messages import EventBatch, Snapshot
from kvstore.cluster.records import ClusterError
from kvstore.index import ClusterIndex

log = logging.getLogger("kvtier.events")


class KVEventFeed:
    def __init__(self, index: ClusterIndex, session: aiohttp.ClientSession,
                 interval_s: float = 0.05) -> None:
        self.index, self.session, self.interval_s = index, session, interval_s
        self._sources: dict[str, tuple[str, dict]] = {}   # node -> (url, query)
        self._failing: set[str] = set()

    def add(self, node_id: str, url: str, **query: str) -> None:
        self._sources[node_id] = (url, query)

    def remove(self, node_id: str) -> None:
        self._sources.pop(node_id, None)
        if node_id in self.index.node_ids():
            self.index.remove_node(node_id)

    async def run(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self.interval_s)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(node) for node in list(self._sources)))

    async def poll(self, node_id: str) -> None:
        url, query = self._sources[node_id]
        known = node_id in self.index.node_ids() and not self.index.is_stale(node_id)
        params = {**query, "after": str(self.index.next_seq(node_id) - 1)} if known else query
        try:
            async with self.session.get(url, params=params) as r:
                body, kind = await r.read(), r.headers.get(EVENTS_KIND_HEADER)
                r.raise_for_status()
            self._apply(node_id, kind, body)
        except (aiohttp.ClientError, asyncio.TimeoutError, ClusterError) as e:
            if node_id not in self._failing:  # once per outage, not every poll
                log.warning("could not read KV events of %s (%s); retrying", node_id, e)
            self._failing.add(node_id)
            return
        self._failing.discard(node_id)

    def _apply(self, node_id: str, kind: str | None, body: bytes) -> None:
        if kind == "snapshot":
            snap = Snapshot.decode(body)
            if node_id in self.index.node_ids():
                self.index.remove_node(node_id)  # a snapshot replaces all we knew
            self.index.add_node(node_id)
            self.index.apply_snapshot(node_id, snap.seq, snap.blocks)
            return
        if kind != "events":
            raise ClusterError(f"{node_id} answered neither events nor a snapshot")
        for event in EventBatch.decode(body).events:
            self.index.apply(dataclasses.replace(event, node_id=node_id))
