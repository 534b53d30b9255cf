"""ClusterMember: one node's presence in an etcd-coordinated pool.

Runs on the daemon's event loop. `start()` registers the node under a lease, loads the
members and follows them with a watch, and campaigns for the leader key. A background task
refreshes the lease every ttl/3; if the lease was lost anyway (a long pause, a partition),
the node registers again under a new one and campaigns again.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import NamedTuple

import aetcd
from aetcd import transactions as txn

from kvstore.cluster.records import ClusterError, EtcdAddress, NodeRecord

log = logging.getLogger("kvtier.cluster")

ETCD_ERRORS = (aetcd.ClientError, aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError,
               aetcd.InternalError)


class Change(enum.Enum):
    JOINED = "joined"
    LEFT = "left"
    LEADER = "leader"     # node_id is the new leader, or None while the role is vacant


class MembershipEvent(NamedTuple):
    change: Change
    node_id: str | None
    at: float             # time.monotonic() when this member saw it


async def connect(address: EtcdAddress, timeout_s: float = 3.0) -> aetcd.Client:
    """A client for the first endpoint that answers."""
    failures = []
    for host, port in address.endpoints:
        client = aetcd.Client(host=host, port=port, timeout=timeout_s)
        try:
            await asyncio.wait_for(client.status(), timeout_s)
            return client
        except (*ETCD_ERRORS, asyncio.TimeoutError, OSError) as e:
            failures.append(f"{host}:{port}: {type(e).__name__}")
            await client.close()
    raise ClusterError(f"no etcd endpoint answered ({'; '.join(failures)}); is etcd running "
                       "and the address right?")


class ClusterMember:
    def __init__(self, address: EtcdAddress, record: NodeRecord | None, ttl_s: int = 5,
                 campaign: bool = True) -> None:
        """`record` None: an observer (a client) that follows the members and the leader
        without registering or campaigning."""
        if ttl_s < 2:
            raise ClusterError("the etcd lease TTL must be at least 2 s")
        self.address, self.record, self.ttl_s = address, record, ttl_s
        self.campaign = campaign and record is not None
        self.members: dict[str, NodeRecord] = {}
        self.leader_id: str | None = None
        self._client: aetcd.Client | None = None
        self._lease = None
        self._tasks: list[asyncio.Task] = []
        self._queues: list[asyncio.Queue] = []
        self._node_key = f"{address.prefix}/nodes/{record.node_id if record else ''}".encode()
        self._leader_key = f"{address.prefix}/leader".encode()

    @property
    def is_leader(self) -> bool:
        return self.record is not None and self.leader_id == self.record.node_id

    def subscribe(self) -> asyncio.Queue:
        """A queue that receives every MembershipEvent this member sees from now on."""
        q: asyncio.Queue = asyncio.Queue()
        self._queues.append(q)
        return q

    async def start(self) -> None:
        self._client = await connect(self.address)
        if self.record is not None:
            await self._register()
        revision = await self._load()
        self._tasks = [asyncio.create_task(self._follow(revision + 1), name="etcd-watch")]
        if self.record is not None:
            self._tasks.append(asyncio.create_task(self._keepalive(), name="etcd-keepalive"))
        await self._try_lead()

    async def stop(self, graceful: bool = True) -> None:
        """Leave. Graceful: revoke the lease so the others see it at once; otherwise the
        node simply goes silent (as in a crash) and leaves when its lease expires."""
        for task in self._tasks:
            task.cancel()
        # each step bounded: a watch or keepalive stuck in a gRPC call that ignores the
        # cancel (seen once after a partition healed) must not hang the caller's close
        await _bounded(asyncio.gather(*self._tasks, return_exceptions=True), STOP_STEP_S)
        self._tasks = []
        if self._client is None:
            return
        if graceful and self._lease is not None:
            try:
                await _bounded(self._lease.revoke(), STOP_STEP_S)
            except ETCD_ERRORS:
                pass  # etcd is gone: the lease will expire on its own
        await _bounded(self._client.close(), STOP_STEP_S)
        self._client = None

    async def wait_for(self, predicate, timeout_s: float) -> None:
        """Wait until predicate(self) holds (checked after each membership change)."""
        q = self.subscribe()
        try:
            deadline = time.monotonic() + timeout_s
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClusterError(f"cluster state not reached within {timeout_s:.1f} s "
                                       f"(members {sorted(self.members)}, leader {self.leader_id})")
                try:
                    await asyncio.wait_for(q.get(), min(left, 0.5))
                except asyncio.TimeoutError:
                    pass
        finally:
            self._queues.remove(q)

    # ------------------------------------------------------------------ internals

    async def _register(self) -> None:
        self._lease = await self._client.lease(self.ttl_s)
        await self._client.put(self._node_key, self.record.encode(), lease=self._lease)

    async def _load(self) -> int:
        """Read the members and the leader; publish what changed since the last view."""
        nodes = await self._client.get_prefix(f"{self.address.prefix}/nodes/".encode())
        seen = {rec.node_id: rec for rec in (NodeRecord.decode(kv.value) for kv in nodes)}
        for node_id in set(self.members) - set(seen):
            del self.members[node_id]
            self._publish(Change.LEFT, node_id)
        for node_id, rec in seen.items():
            if self.members.setdefault(node_id, rec) is rec:
                self._publish(Change.JOINED, node_id)
            self.members[node_id] = rec
        leader = await self._client.get(self._leader_key)
        self._set_leader(leader.value.decode() if leader else None)
        return nodes.header.revision

    async def _try_lead(self) -> None:
        if not self.campaign or self.leader_id is not None:
            return
        won, _ = await self._client.transaction(
            compare=[txn.Create(self._leader_key) == 0],
            success=[txn.Put(self._leader_key, self.record.node_id.encode(), self._lease)],
            failure=[])
        if won:
            self._set_leader(self.record.node_id)

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                reply = await self._lease.refresh()
                if reply is None or reply.TTL <= 0:  # expired while we were away: join again
                    await self._register()
                    await self._try_lead()
            except ETCD_ERRORS:
                continue  # etcd unreachable for now; the watch side reports the outage

    async def _follow(self, start_revision: int) -> None:
        """Watch from a revision; when the watch breaks (etcd restarted, a network fault),
        read the state again and watch on from there."""
        while True:
            try:
                await self._watch(start_revision)
            except ETCD_ERRORS:
                await asyncio.sleep(0.5)
                try:
                    start_revision = await self._load() + 1
                    await self._try_lead()
                except ETCD_ERRORS:
                    continue

    async def _watch(self, start_revision: int) -> None:
        prefix = f"{self.address.prefix}/".encode()
        watch = await self._client.watch_prefix(prefix, start_revision=start_revision)
        async for event in watch:
            if event.kv.key == self._leader_key:
                await self._on_leader_event(event)
            elif event.kv.key.startswith(prefix + b"nodes/"):
                self._on_node_event(event)

    def _on_node_event(self, event) -> None:
        node_id = event.kv.key.rsplit(b"/", 1)[-1].decode()
        if event.kind == "PUT":
            joined = node_id not in self.members
            self.members[node_id] = NodeRecord.decode(event.kv.value)
            if joined:
                self._publish(Change.JOINED, node_id)
        elif self.members.pop(node_id, None) is not None:
            self._publish(Change.LEFT, node_id)

    async def _on_leader_event(self, event) -> None:
        if event.kind == "PUT":
            self._set_leader(event.kv.value.decode())
            return
        self._set_leader(None)
        await self._try_lead()

    def _set_leader(self, node_id: str | None) -> None:
        if node_id != self.leader_id:
            self.leader_id = node_id
            self._publish(Change.LEADER, node_id)

    def _publish(self, change: Change, node_id: str | None) -> None:
        event = MembershipEvent(change, node_id, time.monotonic())
        for q in self._queues:
            q.put_nowait(event)


STOP_STEP_S = 2.0


async def _bounded(aw, timeout_s: float) -> None:
    """Await `aw` for at most timeout_s; past that, leave it (the lease then just expires)."""
    try:
        await asyncio.wait_for(aw, timeout_s)
    except asyncio.TimeoutError:
        log.warning("etcd did not answer within %.0f s while leaving; moving on", timeout_s)
