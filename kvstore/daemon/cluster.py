"""A daemon's part in an etcd-coordinated pool.

Every node: registers in etcd (`ClusterMember`), and ships the KV events of each of its
namespace stores to the current leader, or a full snapshot when the leader is new to it,
when an earlier shipment failed, or when the leader reports a gap. The leader: keeps one
`ClusterIndex` per namespace and answers `/cluster/locate` (who holds which block, and the
longest prefix per node). Data never flows through the leader: clients fetch from holders.
Node-to-node calls carry the cluster token (the first admin token) when auth is on.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Mapping

import aiohttp
from aiohttp import web

from kvstore.cluster.membership import Change, ClusterMember
from kvstore.cluster.messages import (TENANT_LOCATE_HASHES, EventBatch, Locate, Located,
                                      NamespaceRoot, Snapshot, TenantLocate)
from kvstore.cluster.records import ClusterError, NodeRecord
from kvstore.daemon.access import grant_of, require_admin
from kvstore.daemon.config import ADMIN, DaemonConfig
from kvstore.daemon.namespaces import Hosted, Registry
from kvstore.errors import StoreClosedError
from kvstore.index import ClusterIndex
from kvstore.keys import Namespace
from kvstore.logevery import LogEvery
from kvstore.wire import netloc

log = logging.getLogger("kvtier.cluster")
MSGPACK = "application/msgpack"


class MetadataService:
    """The leader's state: a ClusterIndex per namespace. Runs on the event loop only.
    `members`: the pool's live members (the membership's own dict, kept current by it), by
    which `verified` judges who speaks for a namespace; None: every reporter does."""

    def __init__(self, members: Mapping[str, object] | None = None) -> None:
        self.indexes: dict[int, ClusterIndex] = {}
        # ns id -> each root hash nodes named it by -> those nodes (a root leaves with the
        # last node that named it: a stale one left the id unverified for the leader's life)
        self.roots: dict[int, dict[bytes, set[str]]] = {}
        self.members = members
        self.empty: dict[int, set[str]] = {}  # ns id -> nodes that hold none of it (their
        # last snapshot of it was empty: they are in no index, yet known)
        self.term: tuple | None = None  # the leader term this index is of (ClusterMember.leader_term)

    def note_root(self, msg: NamespaceRoot) -> None:
        if bytes(msg.root)[:8] != msg.ns_id.to_bytes(8, "little"):
            raise ClusterError(f"root {bytes(msg.root).hex()} is not namespace {msg.ns_id:016x}'s")
        roots = self.roots.setdefault(msg.ns_id, {})
        root = bytes(msg.root)
        for other in [r for r, by in roots.items() if r != root and msg.node_id in by]:
            roots[other].discard(msg.node_id)  # (a node names one root an id: a restart
            if not roots[other]:  # serving another namespace of it takes the first one's
                del roots[other]  # place)
        if root in roots or len(roots) < 4:  # (more would be a node lying, or ids colliding:
            roots.setdefault(root, set()).add(msg.node_id)  # unverified either way)

    def verified(self, ns: Namespace) -> bool | None:
        """Whether the index of `ns`'s id holds `ns` itself: True where every live node in
        it named the id by `ns`'s root, and no live node by another; False where one did not
        (another namespace shares the id, or a node of an older version named none); None
        where no live node holds blocks of that id. A node not (or no longer) a member
        speaks for nothing: its blocks are no client's to read."""
        idx = self.indexes.get(ns.ns_id)
        live = self._live
        nodes = {n for n in idx.node_ids() if live(n)} if idx is not None else set()
        if not nodes:
            return None
        named = {root: {n for n in by if live(n)}
                 for root, by in self.roots.get(ns.ns_id, {}).items()}
        named = {root: by for root, by in named.items() if by}
        mine = named.get(bytes(ns.root_hash), set())
        return set(named) == {bytes(ns.root_hash)} and nodes <= mine

    def _live(self, node_id: str) -> bool:
        return self.members is None or node_id in self.members

    def index(self, ns_id: int) -> ClusterIndex:
        return self.indexes.setdefault(ns_id, ClusterIndex())

    def apply_events(self, batch: EventBatch) -> bool:
        """Apply a batch; True when the node must send a snapshot (unknown to us, or a gap)."""
        idx = self.indexes.get(batch.ns_id)
        if idx is None or batch.node_id not in idx.node_ids():  # (a snapshot first; not for
            # an empty report of a node known to hold none of it: that was a resync every 5 s)
            return bool(batch.events) or batch.node_id not in self.empty.get(batch.ns_id, ())
        if not batch.events:  # (a node's report when it has none: see ship_once)
            return batch.node_id in idx.stale_nodes()
        stale = False
        for event in batch.events:
            stale = idx.apply(event).stale
        return stale

    def apply_snapshot(self, snap: Snapshot) -> None:
        idx = self.indexes.get(snap.ns_id)
        if idx is not None and snap.node_id in idx.node_ids():
            idx.remove_node(snap.node_id)  # a new incarnation may restart its seqs
        if not any(snap.blocks.values()):
            # the node holds none of the id (its namespace cleared there, or not filled
            # yet): no holder, and it speaks for nothing in `verified`. (Kept in with no
            # blocks and, after a clear, no root, it left the id unverified: a namespace
            # cleared while the leadership moved turned every tenant locate of it into a
            # 409.) Its events, once it has blocks, are answered "resync", and the snapshot
            # that follows brings it back.
            self._drop_roots(snap.ns_id, snap.node_id)
            self.empty.setdefault(snap.ns_id, set()).add(snap.node_id)
            self._prune(snap.ns_id)
            return
        self._not_empty(snap.ns_id, snap.node_id)
        self.index(snap.ns_id).apply_snapshot(snap.node_id, snap.seq, snap.blocks)

    def forget(self, node_id: str) -> None:
        for ns_id, idx in list(self.indexes.items()):
            if node_id in idx.node_ids():
                idx.remove_node(node_id)
                self._prune(ns_id)
        for ns_id in list(self.roots):
            self._drop_roots(ns_id, node_id)
        for ns_id in [i for i, nodes in self.empty.items() if node_id in nodes]:
            self._not_empty(ns_id, node_id)

    def _not_empty(self, ns_id: int, node_id: str) -> None:
        nodes = self.empty.get(ns_id)
        if nodes is not None:
            nodes.discard(node_id)
            if not nodes:
                del self.empty[ns_id]

    def _prune(self, ns_id: int) -> None:
        """An id's index goes once no node is in it (a namespace cleared everywhere, its
        nodes gone): a leader kept one, and an `empty` entry, for every namespace id it
        ever heard of until its term ended (and listed them all in /cluster)."""
        idx = self.indexes.get(ns_id)
        if idx is not None and not idx.node_ids():
            del self.indexes[ns_id]

    def _drop_roots(self, ns_id: int, node_id: str) -> None:
        """`node_id` names no root of `ns_id` any more (a root leaves with its last node)."""
        roots = self.roots.get(ns_id, {})
        for root, nodes in list(roots.items()):
            nodes.discard(node_id)
            if not nodes:
                del roots[root]
        if not roots:
            self.roots.pop(ns_id, None)

    def locate(self, req: Locate) -> Located:
        idx = self.indexes.get(req.ns_id)
        if idx is None:  # (not `index`: each namespace asked about would stay, empty)
            return Located(tuple(() for _ in req.hashes), ())
        match = idx.query(req.hashes)
        live = self._live
        prefix = sorted(((n, match.length(n)) for n in match.nodes() if live(n)),
                        key=lambda p: (-p[1], p[0]))
        holders = idx.holders(req.hashes)
        if self.members is not None:  # (a node that is no member: no client can read it,
            holders = [tuple(n for n in hs if live(n)) for hs in holders]  # and it spoke
        return Located(tuple(holders), tuple(prefix))  # for nothing in `verified`)


class NoRoute(ClusterError):
    """The leader has no such route (an older version)."""


class LeaderUnsure(ClusterError):
    """The leader could not vouch for its role this moment (503: `_check_leading`)."""


class ClusterAgent:
    def __init__(self, cfg: DaemonConfig, registry: Registry, data_port: int, http_port: int) -> None:
        host = cfg.advertise or cfg.host
        self.cfg, self.registry = cfg, registry
        record = NodeRecord(cfg.node_id, netloc(host, data_port),
                            f"http://{netloc(host, http_port)}")
        self.member = ClusterMember(cfg.etcd_address(), record, ttl_s=cfg.cluster_ttl_s)
        self.service = MetadataService(self.member.members)
        self._reported_to: tuple | None = None  # the leader term reported to
        self._known: set[int] = set()   # namespaces the current leader has a snapshot of
        self._rootless: set[str] = set()  # leaders without /cluster/namespace (older ones)
        self._after: dict[int, int] = {}  # per namespace: the last event seq shipped
        self._posted_at: dict[int, float] = {}  # per namespace: its last report's time
        self._reported: dict[int, Hosted] = {}  # per namespace: the store reported (a
        # namespace cleared and opened again has a new one, its events numbered anew)
        self._failing = False
        self._failures = LogEvery(60.0)  # unexpected errors: a traceback a minute at most
        self._held_off: dict[int, float] = {}  # namespaces whose report failed: until when
        self._tasks: list[asyncio.Task] = []
        self._http: aiohttp.ClientSession | None = None

    @property
    def headers(self) -> dict[str, str]:
        token = self.cfg.cluster_token
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        url = self.member.record.control_url
        if not await self._answers(url):
            # (one that led anyway took the index from the whole pool: no node could
            # report to it, nor any client locate through it, and it never stepped down)
            self.member.campaign = False
            log.error("this node's control plane does not answer at its advertised address "
                      "%s: it joins the pool but never leads it; set --advertise to an "
                      "address the other nodes and the clients reach", url)
        changes = self.member.subscribe()
        await self.member.start()
        self._tasks = [asyncio.create_task(self._ship_forever(), name="kv-event-shipper"),
                       asyncio.create_task(self._follow(changes), name="cluster-follow")]

    async def _answers(self, url: str) -> bool:
        """Does this node's control plane answer at `url` (its advertised address)?"""
        try:
            async with self._http.get(f"{url}/healthz", headers=self.headers,
                                      timeout=aiohttp.ClientTimeout(total=3)) as r:
                return r.status < 500
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.member.stop(graceful=True)
        if self._http is not None:
            await self._http.close()

    async def _follow(self, changes: asyncio.Queue) -> None:
        while True:
            event = await changes.get()
            if event.change is Change.LEFT:
                self.service.forget(event.node_id)
            elif event.change is Change.LEADER:
                self._new_term()

    def _new_term(self) -> None:
        """A term of this node's own starts from an empty index (by the term, not by
        is_leader, which also asks the clock: it could be false now and true later, and the
        last term's index was served again). Called for each LEADER event: the term is the
        membership's current one, so events of a term already begun change nothing."""
        term = self.member.leader_term
        if term[0] == self.cfg.node_id and self.service.term != term:
            log.info("this node leads the cluster metadata now")
            self.service = MetadataService(self.member.members)
            self.service.term = term

    async def _ship_forever(self) -> None:
        backoff = 0.0  # grows while the leader refuses: a full snapshot was rebuilt and sent
        while True:  # every interval (50 ms), a quarter of a core, for as long as it lasted
            await asyncio.sleep(self.cfg.event_interval_s + backoff)
            try:
                await self.ship_once()
                self._failing, backoff = False, 0.0
            except LeaderUnsure:  # (what it has stays: the same events go again next time)
                backoff = max(backoff, self.cfg.event_interval_s)
            except Exception as e:  # noqa: BLE001 - the shipper must not end: a node whose
                # task died reported nothing to any leader for the rest of its life
                if not isinstance(e, (aiohttp.ClientError, asyncio.TimeoutError, ClusterError)):
                    skipped = self._failures.due()
                    if skipped is not None:
                        log.exception("reporting KV events to the leader failed (%d more such "
                                      "failures since the last line); will resync", skipped)
                elif not self._failing:  # once per outage, not every interval
                    log.warning("could not report KV events to the leader (%s); will resync", e)
                self._failing = True
                self._known.clear()
                backoff = min(max(2 * backoff, self.cfg.event_interval_s), SHIP_BACKOFF_MAX_S)

    async def ship_once(self) -> None:
        term = self.member.leader_term
        leader = term[0]
        rec = self.member.members.get(leader) if leader else None
        if rec is None or self.member.out:  # (out: another daemon reports under this id)
            self._reported_to = None  # (back in the pool: snapshots first)
            return
        if term != self._reported_to:  # a new term (the same node winning again too):
            self._reported_to, self._known = term, set()  # everything anew
            self._rootless.discard(leader)  # (it may have been upgraded since)
        hosted_now = {h.ns.ns_id: h for h in self.registry.hosted()}
        for ns_id in [n for n, h in self._reported.items() if hosted_now.get(n) is not h]:
            await self._report_gone(rec, ns_id)
        now = time.monotonic()
        for ns_id in [n for n, until in self._held_off.items() if until <= now or n not in hosted_now]:
            del self._held_off[ns_id]
        for ns_id, hosted in hosted_now.items():
            if ns_id in self._held_off:
                continue
            try:
                await self._report(rec, ns_id, hosted)
            except StoreClosedError:
                continue  # cleared meanwhile: reported gone next round
            except (aiohttp.ClientError, asyncio.TimeoutError, ClusterError):
                raise  # the leader's trouble: the round ends (see _ship_forever)
            except Exception:  # noqa: BLE001 - this namespace's trouble: the others go on
                self._known.discard(ns_id)  # (its snapshot goes again, in a while)
                self._held_off[ns_id] = time.monotonic() + SHIP_BACKOFF_MAX_S
                skipped = self._failures.due()
                if skipped is not None:
                    log.exception("reporting namespace %016x to the leader failed (%d more "
                                  "such failures since the last line)", ns_id, skipped)

    async def _report(self, rec: NodeRecord, ns_id: int, hosted: Hosted) -> None:
        """One namespace's report: its root and a snapshot if the leader has none of it,
        else its events since the last report (an empty batch now and then)."""
        leader = rec.node_id
        if ns_id not in self._known:
            self._reported[ns_id] = hosted  # (before its root: cleared before its snapshot,
            # it is reported gone, and the root it named leaves with that report)
            if leader not in self._rootless:
                try:
                    await self._post(rec, "namespace", NamespaceRoot(
                        self.cfg.node_id, ns_id, bytes(hosted.ns.root_hash)).encode())
                except NoRoute:  # (a leader of an older version: snapshots only)
                    self._rootless.add(leader)
            loop = asyncio.get_running_loop()
            seq, blocks = await loop.run_in_executor(None, hosted.snapshot)
            await self._post(rec, "snapshot", Snapshot(self.cfg.node_id, ns_id, seq, blocks).encode())
            self._known.add(ns_id)
            self._after[ns_id] = seq
            self._posted_at[ns_id] = time.monotonic()
            return
        events = hosted.events_after(self._after[ns_id])
        if events is None:  # another reader's snapshot took them: resync
            self._known.discard(ns_id)
        elif events or (leader != self.cfg.node_id  # (a leader hears of its own terms)
                        and time.monotonic() - self._posted_at.get(ns_id, 0.0) >= REPORT_EVERY_S):
            # (none for a while: an empty batch, which a leader that does not know this
            # node's blocks, a new term's, answers "resync": an idle node's blocks were
            # missing from the index of a leader that won again unseen)
            reply = await self._post(rec, "events", EventBatch(self.cfg.node_id, ns_id, events).encode())
            if events:
                self._after[ns_id] = events[-1].seq
            self._posted_at[ns_id] = time.monotonic()
            if reply == b"resync":
                self._known.discard(ns_id)

    async def _report_gone(self, rec: NodeRecord, ns_id: int) -> None:
        """A namespace this node reported was cleared (opened again since, or not): the
        leader is sent an empty snapshot of it, so the blocks the cleared store held leave
        its index (a leader that never heard of it drops nothing), and the next store of the
        namespace is reported from a snapshot of its own. Its cursor is forgotten: the next
        store numbers its events from the start, and the old cursor skipped that many of
        them (blocks it stored missing from the index for good), or was kept for as long as
        the daemon ran."""
        await self._post(rec, "snapshot", Snapshot(self.cfg.node_id, ns_id, -1, {}).encode())
        del self._reported[ns_id]
        self._known.discard(ns_id)
        self._after.pop(ns_id, None)
        self._posted_at.pop(ns_id, None)

    async def _post(self, rec: NodeRecord, what: str, body: bytes) -> bytes:
        async with self._http.post(f"{rec.control_url}/cluster/{what}", data=body,
                                   headers={**self.headers, "Content-Type": MSGPACK}) as resp:
            if resp.status in (404, 405) and what == "namespace":
                raise NoRoute(what)
            if resp.status == 503:
                raise LeaderUnsure(rec.node_id)
            if resp.status != 200:
                raise ClusterError(f"leader {rec.node_id} answered {resp.status} to {what}: "
                                   f"{(await resp.text())[:200]}")
            return await resp.read()


class ClusterSlot:
    """Where the app finds its agent: set by `serve` once the control plane's port is known
    (after the app has started, when app state can no longer change)."""

    agent: ClusterAgent | None = None

    def __init__(self) -> None:
        self.tenant_locates: dict[str, int] = {}  # tenant -> its locates being answered


SLOT = web.AppKey("cluster_slot", ClusterSlot)


def _agent(request: web.Request) -> ClusterAgent:
    agent = request.app[SLOT].agent
    if agent is None:
        raise web.HTTPNotFound(text="this daemon is not part of a cluster (start it with --cluster)\n")
    return agent


SHIP_BACKOFF_MAX_S = 5.0  # the longest wait between reports to a leader that refuses them
REPORT_EVERY_S = 5.0  # a namespace with no events reports (an empty batch) this often


def _leader_only(request: web.Request, admin: bool = True) -> ClusterAgent:
    if admin:
        require_admin(request)
    agent = _agent(request)
    _check_leading(agent)
    return agent


def _check_leading(agent: ClusterAgent) -> None:
    """409 where another node leads; 503 (Retry-After) where this one holds the leader key
    but no refresh of its lease got through lately (it may have lapsed in etcd: kvstore.
    cluster.membership), which usually passes within a refresh: reporters keep their place
    and clients ask again (a 409 made every node send its whole snapshot again and every
    client ask all members for a minute)."""
    m = agent.member
    if m.is_leader and agent.service.term == m.leader_term:
        return
    if m.leader_id == agent.cfg.node_id and not m.out:  # (unconfirmed lease, the key under
        raise web.HTTPServiceUnavailable(headers={"Retry-After": "1"}, text=(  # another of
            "this node cannot vouch for the leader role this moment (its lease unconfirmed, "
            "or a new term's index not set up yet); ask again shortly\n"))  # its leases,
    raise web.HTTPConflict(text=f"not the leader; the leader is {m.leader_id}\n")  # a new term)


MAX_CONTROL_BODY = 1 << 30  # a cluster snapshot, 18 bytes a block: ~60M blocks. aiohttp's
# default (1 MiB, ~58k blocks) answered a bigger namespace's snapshot 413, for good: that
# node's blocks never reached the leader's index. (Bodies are read after the token check.)
# A tenant's locate: its namespace is in the body, so the body is read before the tenant
# check. It is small, announced and quick (a tenant announcing 4 MiB and sending nothing kept
# a connection busy, out of the gate's reach, for 11 s), at most TENANT_LOCATE_HASHES hashes
# (233k copies of one hash cost the leader's event loop 0.4 s and a 29 MB reply each: the
# lease keepalive missed, leadership moved) and TENANT_LOCATES at once per tenant (429).
MAX_TENANT_BODY = 256 << 10
TENANT_LOCATES = 4
TENANT_BODY_GRACE_S = 2.0
BODY_GRACE_S = 10.0  # a report's body must come within this plus its length at
MIN_BODY_RATE = 4 << 20  # bytes/s (as a data-plane put's payload): else 408 and closed


async def _leader_call(request: web.Request, message, act, admin: bool = True) -> web.Response:
    """Decode the body as `message`, run `act(service, decoded) -> bytes` on the leader
    (`act` may raise HTTP errors: with `admin` False any known token gets this far, and
    `act` checks the request against it). The body is read within a deadline: a sender
    trickling it held its connection (one of the control plane's capped slots) for as long
    as it liked."""
    grace = BODY_GRACE_S
    if not admin and grant_of(request) != ADMIN:
        size = request.content_length
        if size is None or size > MAX_TENANT_BODY:
            raise web.HTTPRequestEntityTooLarge(MAX_TENANT_BODY, size or 0, text=(
                f"a tenant's request body must announce its length (Content-Length) and be "
                f"at most {MAX_TENANT_BODY} bytes: locate fewer hashes at a time\n"))
        grace = TENANT_BODY_GRACE_S
    agent = _leader_only(request, admin)
    service = agent.service
    size = request.content_length or MAX_CONTROL_BODY
    try:
        async with asyncio.timeout(grace + size / MIN_BODY_RATE):
            raw = await request.read()
    except TimeoutError:
        slow = web.Response(status=408, text="the request body came too slowly\n")
        slow.force_close()  # (what it sent so far leaves the connection out of step)
        return slow
    _check_leading(agent)  # (again: the body may have taken seconds)
    if agent.service is not service:  # a new term began meanwhile: a snapshot applied to
        raise web.HTTPServiceUnavailable(headers={"Retry-After": "1"}, text=(  # its index
            "the leader's index was reset; send again\n"))  # without the root before it
    try:
        body = act(service, message.decode(raw))
    except ClusterError as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from e
    return web.Response(body=body, content_type=MSGPACK)


async def post_events(request: web.Request) -> web.Response:
    return await _leader_call(request, EventBatch,
                              lambda svc, batch: b"resync" if svc.apply_events(batch) else b"ok")


async def post_snapshot(request: web.Request) -> web.Response:
    return await _leader_call(request, Snapshot,
                              lambda svc, snap: svc.apply_snapshot(snap) or b"ok")


async def post_namespace(request: web.Request) -> web.Response:
    return await _leader_call(request, NamespaceRoot,
                              lambda svc, msg: svc.note_root(msg) or b"ok")


async def post_locate(request: web.Request) -> web.Response:
    """The admin's: which nodes hold blocks of any namespace, named by its id."""
    return await _leader_call(request, Locate, lambda svc, req: svc.locate(req).encode())


async def post_locate_tenant(request: web.Request) -> web.Response:
    """Any token's, for namespaces it may use: the body names the namespace whole, its id
    computed here and its tenant checked against the token (an admin's: any). A tenant's
    pool client without it asked every member on each miss."""
    grant = grant_of(request)

    def locate(svc: MetadataService, req: TenantLocate) -> bytes:
        ns = req.namespace()
        if grant != ADMIN and ns.tenant != grant:
            raise web.HTTPForbidden(text=f"this token is for tenant {grant!r}, not {ns.tenant!r}\n")
        verified = svc.verified(ns)
        if verified is False:  # (answered by id alone, another namespace's holders could be
            # told: nodes of an older version name no roots, and ids may collide)
            raise web.HTTPConflict(text=f"the index of namespace {ns.ns_id:016x} cannot be "
                                   "told apart from another's: ask the nodes\n")
        if len(req.hashes) > TENANT_LOCATE_HASHES:
            raise web.HTTPRequestEntityTooLarge(TENANT_LOCATE_HASHES, len(req.hashes), text=(
                f"at most {TENANT_LOCATE_HASHES} hashes a request\n"))
        return svc.locate(Locate(ns.ns_id, req.hashes)).encode()
    busy = request.app[SLOT].tenant_locates
    if busy.get(grant, 0) >= TENANT_LOCATES:  # (before its body is read)
        raise web.HTTPTooManyRequests(text=f"at most {TENANT_LOCATES} locates at once per token\n")
    busy[grant] = busy.get(grant, 0) + 1
    try:
        return await _leader_call(request, TenantLocate, locate, admin=False)
    finally:
        busy[grant] -= 1
        if not busy[grant]:
            del busy[grant]


async def get_nodes(request: web.Request) -> web.Response:
    """The members and the leader for any token; the leader's index (every namespace's
    id and the nodes holding its blocks) for an admin's only: a tenant learns nothing of
    other tenants' namespaces."""
    admin = grant_of(request) == ADMIN
    agent = _agent(request)
    m = agent.member
    return web.json_response({
        "node_id": agent.cfg.node_id, "leader": m.leader_id, "time": time.time(),
        "members": {n: {"data_addr": r.data_addr, "control_url": r.control_url}
                    for n, r in sorted(m.members.items())},
        "index": {f"{ns:016x}": {"nodes": list(idx.node_ids()), "stale": list(idx.stale_nodes())}
                  for ns, idx in agent.service.indexes.items()} if m.is_leader and admin else None})


def add_routes(app: web.Application) -> None:
    app[SLOT] = ClusterSlot()
    app.router.add_post("/cluster/events", post_events)
    app.router.add_post("/cluster/snapshot", post_snapshot)
    app.router.add_post("/cluster/locate", post_locate)
    app.router.add_post("/cluster/locate-tenant", post_locate_tenant)
    app.router.add_post("/cluster/namespace", post_namespace)
    app.router.add_get("/cluster/nodes", get_nodes)
