"""ClusterMember: one node's presence in an etcd-coordinated pool.

Runs on the daemon's event loop. `start()` registers the node under a lease, loads the
members and follows them with a watch, and campaigns for the leader key. A background task
refreshes the lease every ttl/3; if the lease was lost anyway (a long pause, a partition),
or the node's key went, the node registers again under a new one and campaigns again.

A node leads only while its lease is surely alive by its own clock: until the time it sent
the last refresh etcd answered, plus the TTL etcd granted, less LEASE_MARGIN_S. etcd counts
the same TTL from the moment it took that refresh, later, so this node stops leading before
etcd can hand the leader key to another. (The clock is CLOCK_BOOTTIME: it runs on while the
host is suspended, and so errs the safe way.) (It led on for as long as a partition from
etcd lasted: no refresh got through, no watch event either, and the node beside it that etcd
had made leader in the meantime led too.) It also leads only where the leader key is held
under its current lease: one that re-registered under a new lease (a revoke that failed
while it left the pool) must not lead by the new lease's clock on a key the old one holds.

A term is the leader's id and the lease its key is held under (`leader_term`): the same
node winning again is a new term, and members hear of it (a LEADER event) as of any other.

A node id is one daemon's: registering waits out a dead predecessor's key (its lease runs
out within the TTL) and refuses to start beside a live daemon of the same id (which used to
take its key over silently: the first daemon dropped out of the pool for good, its lease
still holding the leader key). A record in etcd that does not decode (another version's, a
hand-written one) is logged and skipped: it ended the watch, without a word, and joining
nodes and new clients failed on it.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import NamedTuple

import aetcd
from aetcd import rpc as etcd_rpc
from aetcd import transactions as txn
from aetcd import watcher as etcd_watcher
import grpc

from kvstore.cluster.records import ClusterError, EtcdAddress, EtcdTls, NodeRecord
from kvstore.logevery import LogEvery

log = logging.getLogger("kvtier.cluster")
_CLEAR_CREDENTIALS = LogEvery(3600.0)  # etcd passwords sent without TLS, off this host

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
    return (await connect_from(address, 0, timeout_s))[0]


async def connect_from(address: EtcdAddress, first: int,
                       timeout_s: float = 3.0) -> tuple[aetcd.Client, int]:
    """(a client, its endpoint's index) for the first endpoint that answers, trying them
    in order from `first` round to the one before it."""
    failures, n = [], len(address.endpoints)
    for k in range(n):
        i = (first + k) % n
        host, port = address.endpoints[i]
        client = etcd_client(address, i, timeout_s)
        try:
            # (a key read under the prefix, not Status: on an etcd with auth on, Status is
            # the root user's, and a node's user may read and write its prefix alone)
            await asyncio.wait_for(client.get(f"{address.prefix}/".encode()), timeout_s)
            return client, i
        except (*ETCD_ERRORS, asyncio.TimeoutError, OSError) as e:
            await client.close()
            if _is_refusal(e):
                raise ClusterError(_refused(address, host, port, e)) from None
            failures.append(f"{host}:{port}: {type(e).__name__}")
    hint = (" Over TLS: is the CA etcd's certificate chains to the one given "
            "(--etcd-ca-file), does the certificate name the host in the address, and does "
            "etcd want a client certificate (--etcd-cert-file, --etcd-key-file)?"
            if address.tls else
            " If etcd serves TLS (https:// client URLs), use etcds:// or --etcd-ca-file.")
    raise ClusterError(f"no etcd endpoint answered ({'; '.join(failures)}); is etcd running "
                       f"and the address right?{hint}")


def etcd_client(address: EtcdAddress, i: int, timeout_s: float) -> aetcd.Client:
    """A client (not connected yet) for endpoint `i` of `address`: over TLS where the
    address says so. Credentials sent in the clear to a host other than this one are
    warned of (anyone on the path reads the password)."""
    host, port = address.endpoints[i]
    user, password = address.credentials or (None, None)
    if address.tls is not None:
        return TlsEtcdClient(address.tls, host=host, port=port, username=user,
                             password=password, timeout=timeout_s)
    if address.credentials and not _loopback(host):
        if _CLEAR_CREDENTIALS.due() is not None:  # (each reconnect connects again)
            log.warning("the password of etcd user %r goes to %s:%d in the clear: serve "
                        "etcd over TLS and pass --etcd-ca-file (or use etcds://)", user, host,
                        port)
    return aetcd.Client(host=host, port=port, username=user, password=password,
                        timeout=timeout_s)


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


class TlsEtcdClient(aetcd.Client):
    """aetcd's client over a TLS channel. aetcd opens only plain channels, and takes no
    credentials for one: this is its `connect` with a secure channel instead, the rest
    (the login, the stubs, the watcher) done as aetcd does it."""

    def __init__(self, tls: EtcdTls, **kwargs) -> None:
        super().__init__(**kwargs)
        self._credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is at it: wait for that one
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            self.channel = etcd_rpc.secure_channel(f"{self._host}:{self._port}",
                                                   self._credentials,
                                                   options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = etcd_rpc.AuthStub(self.channel)
                try:
                    reply = await self.auth_stub.Authenticate(
                        etcd_rpc.AuthenticateRequest(name=self._username,
                                                     password=self._password),
                        timeout=self._timeout)
                except etcd_rpc.AioRpcError as e:
                    aetcd.exceptions._handle_exception(e)  # (aetcd's errors, as its own)
                self.metadata = (("token", reply.token),)
            self.kvstub = etcd_rpc.KVStub(self.channel)
            self.clusterstub = etcd_rpc.ClusterStub(self.channel)
            self.leasestub = etcd_rpc.LeaseStub(self.channel)
            self.maintenancestub = etcd_rpc.MaintenanceStub(self.channel)
            self._watcher = etcd_watcher.Watcher(etcd_rpc.WatchStub(self.channel),
                                                 timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def _is_refusal(e: BaseException) -> bool:
    """Did etcd refuse who we are (no user, a wrong password, no permission on the
    prefix), rather than fail to answer? (aetcd raises gRPC's UNAUTHENTICATED as
    UnauthenticatedError, a failed login as InvalidArgumentError, PERMISSION_DENIED as a
    bare ClientError: told apart by etcd's own words.)"""
    text = str(e).lower()
    return isinstance(e, aetcd.exceptions.UnauthenticatedError) or (
        isinstance(e, aetcd.ClientError) and any(
            w in text for w in ("authentication failed", "permission denied", "user name is empty",
                                "invalid auth token", "user name not found")))


def _refused(address: EtcdAddress, host: str, port: int, e: Exception) -> str:
    """What to say of an etcd that refused this node's credentials (or their lack)."""
    if address.credentials is None:
        return (f"etcd at {host}:{port} requires a user ({type(e).__name__}): pass "
                "--etcd-credentials-file (etcd_credentials_file= for a pool client)")
    return (f"etcd at {host}:{port} refused user {address.credentials[0]!r} "
            f"({type(e).__name__}: {e}); check the credentials file and that the user's "
            f"role may read and write {address.prefix}/")


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
        self._endpoint = 0  # the index of the endpoint _client talks to
        self._switching: asyncio.Lock | None = None  # (see _failover)
        self._lease = None
        self._tasks: list[asyncio.Task] = []
        self._queues: list[asyncio.Queue] = []
        self._keys = f"{address.prefix}/".encode()  # every key of the pool: the two below
        self._nodes = self._keys + b"nodes/"
        self._node_key = self._nodes + (record.node_id if record else "").encode()
        self._leader_key = self._keys + b"leader"
        self._bad_records = LogEvery()  # records in etcd that do not decode
        self._taken = LogEvery()  # this node's id held by another daemon
        self.out = False  # another daemon took this node's id: no member, never the leader
        self._lease_until = 0.0  # lease_clock() before which the lease is surely alive
        self._leader_lease: int | None = None  # the lease the leader key is held under
        self._leader_rev: int | None = None  # and the revision it was created at (the term)
        self._resigning: asyncio.Task | None = None  # (see _resign_if_lapsed)

    @property
    def is_leader(self) -> bool:
        """This node holds the leader key and its lease is surely alive (see the module)."""
        return (self.record is not None and not self.out and self.leader_id == self.record.node_id
                and self._lease is not None and self._leader_lease == self._lease.id
                and not self.lease_lapsed)

    @property
    def lease_lapsed(self) -> bool:
        """No refresh of this node's lease got through within the TTL: etcd may have let it
        go (a partition, a stalled event loop), so the node must not act on the role it
        last saw."""
        return self.record is not None and lease_clock() >= self._lease_until - LEASE_MARGIN_S

    def subscribe(self) -> asyncio.Queue:
        """A queue that receives every MembershipEvent this member sees from now on."""
        q: asyncio.Queue = asyncio.Queue()
        self._queues.append(q)
        return q

    async def start(self) -> None:
        self._client, self._endpoint = await connect_from(self.address, 0)
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
        if self._resigning is not None:
            self._tasks.append(self._resigning)
            self._resigning = None
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

    async def _register(self, lease=None) -> None:
        """Put this node's record under a new lease (or `lease`, one still alive), creating
        the key only where it is absent: a predecessor's key (this node's own record, on the
        ports this daemon holds now, is taken over at once) is waited out for the TTL and a
        little, in case its lease is still running out; a live daemon's of the same id
        raises ClusterError."""
        mine = self.record.encode()
        deadline = time.monotonic() + self.ttl_s + 1.0
        while True:
            held = await self._client.get(self._node_key)
            compare = ([txn.Create(self._node_key) == 0] if held is None else
                       [txn.Value(self._node_key) == mine] if held.value == mine else None)
            if compare is not None:
                fresh = lease is None
                if fresh:
                    asked = lease_clock()
                    lease = await self._client.lease(self.ttl_s)  # (granted now: one
                    # granted before the wait would have run out during it)
                won, _ = await self._client.transaction(
                    compare=compare, success=[txn.Put(self._node_key, mine, lease)],
                    failure=[])
                if won:
                    self._lease = lease
                    if fresh:
                        self._lease_until = asked + self.ttl_s
                    return
                if fresh:
                    await lease.revoke()
                    lease = None
                continue
            if time.monotonic() > deadline:
                try:
                    other = NodeRecord.decode(held.value).data_addr
                except ClusterError:
                    other = "a record this build cannot read"
                raise ClusterError(
                    f"node id {self.record.node_id!r} is registered in {self.address.prefix} "
                    f"by another live daemon ({other}); give each daemon its own --node-id")
            await asyncio.sleep(0.25)

    async def _load(self) -> int:
        """Read the members and the leader, at one revision (the pool's keys in one read:
        read apart, a leader change between the two reads was read as the state and then
        replayed as events by the watch that starts after the first); publish what changed
        since the last view. Returns the revision read at."""
        found = await self._client.get_prefix(self._keys)
        seen, leader = {}, None
        for kv in found:
            if kv.key == self._leader_key:
                leader = kv
            elif self._is_node_key(kv.key):
                rec = self._record(kv.key, kv.value)
                if rec is not None:
                    seen[rec.node_id] = rec
        for node_id in set(self.members) - set(seen):
            del self.members[node_id]
            self._publish(Change.LEFT, node_id)
        for node_id, rec in seen.items():
            if self.members.setdefault(node_id, rec) is rec:
                self._publish(Change.JOINED, node_id)
            self.members[node_id] = rec
        if leader is not None and not leader.lease:
            await self._drop_unleased_leader(leader.create_revision)
            leader = None
        self._set_leader(_text(leader.value) if leader else None, leader.lease if leader else None,
                         leader.create_revision if leader else None)
        return found.header.revision

    async def _drop_unleased_leader(self, create_revision: int) -> None:
        """A leader key held under no lease was not put by a node (a node's goes with its
        lease): written by hand, or left by another build. Never expiring, it kept the pool
        without a leader for good, through restarts too. A campaigning node deletes that
        key (the one created at `create_revision`: never a real leader's that replaced it);
        every member takes it for no leader meanwhile."""
        if not self.campaign:
            return
        log.warning("the pool's leader key is held under no lease (not a node's): removing it")
        try:
            await self._client.transaction(
                compare=[txn.Create(self._leader_key) == create_revision],
                success=[txn.Delete(self._leader_key)], failure=[])
        except ETCD_ERRORS:
            pass  # tried again at the next read of the pool

    def _record(self, key: bytes, value: bytes) -> NodeRecord | None:
        """The record at a node key, or None (logged) when it does not decode or names
        another node than its key."""
        node_id = _text(key.rsplit(b"/", 1)[-1])
        try:
            rec = NodeRecord.decode(value)
            if rec.node_id != node_id:
                raise ClusterError(f"it names node {rec.node_id!r}")
            return rec
        except ClusterError as e:
            skipped = self._bad_records.due()
            if skipped is not None:
                log.warning("etcd key %s holds no node record this build reads (%s): not a "
                            "member (%d more such records since the last line)",
                            _text(key), e, skipped)
            return None

    async def _failover(self, failed: aetcd.Client) -> bool:
        """`failed`, the client a call to etcd failed on, is given up for one to the next
        endpoint that answers (the lease, which is the cluster's, carried over); whether it
        was. A node held on to the first endpoint that answered at its start: with that one
        etcd member down, the other two healthy, every node's lease ran out and the pool
        stood empty until that member came back. One endpoint: its gRPC channel reconnects
        on its own, nothing to switch to."""
        if len(self.address.endpoints) < 2 or self._client is not failed:
            return False
        if self._switching is None:
            self._switching = asyncio.Lock()
        async with self._switching:
            if self._client is not failed:
                return True  # another task switched meanwhile
            try:
                client, i = await connect_from(self.address, self._endpoint + 1)
            except ClusterError:
                return False  # none answers: tried again at the next failure
            was = self.address.endpoints[self._endpoint]
            self._client, self._endpoint = client, i
            if self._lease is not None:
                self._lease = aetcd.Lease(self._lease.id, self._lease.ttl, client)
            log.warning("etcd at %s:%s stopped answering: following the pool through %s:%s",
                        *was, *self.address.endpoints[i])
        await _bounded(failed.close(), STOP_STEP_S)
        return True

    async def _try_lead(self) -> None:
        if not self.campaign or self.out or self.leader_id is not None or self.lease_lapsed:
            return  # (lapsed: it would not lead on what it won, and no other could)
        won, done = await self._client.transaction(
            compare=[txn.Create(self._leader_key) == 0],
            success=[txn.Put(self._leader_key, self.record.node_id.encode(), self._lease)],
            failure=[])
        if won:
            self._set_leader(self.record.node_id, self._lease.id,
                             done[0].response_put.header.revision)

    async def _keepalive(self) -> None:
        again = False  # a refresh to try at once (its endpoint failed, another took over)
        while True:
            if not again:
                await asyncio.sleep(self.ttl_s / 3)
            again, client = False, self._client
            try:
                if self.out:  # (the daemon that took this id may be gone by now)
                    await self._register()
                    self.out = False
                    log.warning("this node is back in the pool as %s", self.record.node_id)
                    await self._try_lead()
                    continue
                sent = lease_clock()
                reply = await self._lease.refresh()
                if reply is None:  # the keepalive stream ended with no answer: no word on
                    self._resign_if_lapsed()  # the lease either way (an expired one is
                    continue  # answered TTL 0)
                if reply.TTL > 0:
                    self._lease_until = sent + reply.TTL
                    if self.leader_id is None:  # (one it gave up while lapsed, with no
                        await self._try_lead()  # other node to take it)
                else:  # expired while we were away: join again,
                    self.out = True  # no leader meanwhile (another daemon may hold the id now,
                    # and lead: both did until the wait ran out). The leader key went with the
                    # lease: a watch that has not said so yet must not make us lead again
                    if self.leader_id == self.record.node_id:
                        self._set_leader(None)
                    await self._register()
                    self.out = False
                    await self._try_lead()
                    continue
                held = await self._client.get(self._node_key)
                if held is None:  # the key went (deleted by hand, etcd's data lost): put it
                    await self._register(self._lease)  # back under the lease (which may
                    await self._try_lead()  # hold the leader key)
                elif held.value != self.record.encode():
                    raise ClusterError(f"another daemon holds node id {self.record.node_id!r}")
            except ETCD_ERRORS:  # etcd unreachable for now; the watch side reports the
                self._resign_if_lapsed()  # outage
                again = await self._failover(client)
            except ClusterError as e:
                await self._leave_pool(e)

    def _resign_if_lapsed(self) -> None:
        """A leader none of whose refreshes got an answer stops leading by its own clock
        (`lease_lapsed`); but etcd may be taking them all the same (answers lost on the way
        back) and keep its lease, and the leader key with it: the other nodes then wait on
        a leader that answers 503 for as long as that lasts. So once its lease has gone
        unconfirmed for a TTL more (by then etcd has let the lease go unless it is taking
        the refreshes: a shorter stall keeps its term), it gives up the key of its own term
        (compared on the key's creation: never a later term, nor another daemon's key of
        this id while this one is out of the pool), and does not campaign until a refresh
        is answered again; another node takes the lead meanwhile. The delete runs as a task
        of its own (awaited in the refresh loop, its timeout spaced the refreshes out past
        the TTL, and etcd let a healthy node's lease go)."""
        if (self.out or self._lease is None or self.leader_id != self.record.node_id
                or self._leader_lease != self._lease.id or self._leader_rev is None
                or lease_clock() < self._lease_until + self.ttl_s
                or (self._resigning is not None and not self._resigning.done())):
            return
        self._resigning = asyncio.create_task(self._resign(self._leader_rev), name="etcd-resign")

    async def _resign(self, term_rev: int) -> None:
        try:
            await asyncio.wait_for(self._client.transaction(
                compare=[txn.Create(self._leader_key) == term_rev],
                success=[txn.Delete(self._leader_key)], failure=[]), self.ttl_s)
        except (*ETCD_ERRORS, asyncio.TimeoutError):
            pass  # tried again after the next refresh that goes unanswered

    async def _leave_pool(self, why: ClusterError) -> None:
        """Another daemon holds this node's id: stop acting as a member (the leader least of
        all: two daemons of one id both led) and let go of the lease, and with it the leader
        key if this node held it; `_keepalive` tries to come back now and then."""
        skipped = self._taken.due()
        if skipped is not None:
            log.error("this node is out of the pool: %s (%d more since the last line)",
                      why, skipped)
        if self.out:
            return
        self.out = True
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                await lease.revoke()
            except ETCD_ERRORS:
                pass  # it runs out on its own
        if self.leader_id == self.record.node_id:
            self._set_leader(None)

    async def _follow(self, start_revision: int) -> None:
        """Watch from a revision; when the watch breaks (etcd restarted, a network fault,
        anything else: it must not end), read the state again and watch on from there."""
        while True:
            try:
                await self._watch(start_revision)
            except Exception as e:
                if not isinstance(e, ETCD_ERRORS):
                    log.exception("following the pool's members failed; reading them again")
                await asyncio.sleep(0.5)
                client = self._client
                try:
                    start_revision = await self._load() + 1
                    await self._try_lead()
                except Exception as e:
                    if not isinstance(e, ETCD_ERRORS):
                        log.exception("reading the pool's members failed; trying again")
                    else:
                        await self._failover(client)
                    continue

    async def _watch(self, start_revision: int) -> None:
        watch = await self._client.watch_prefix(self._keys, start_revision=start_revision)
        async for event in watch:
            if event.kv.key == self._leader_key:
                await self._on_leader_event(event)
            elif self._is_node_key(event.kv.key):
                self._on_node_event(event)

    def _is_node_key(self, key: bytes) -> bool:
        """A node's key of this pool: one segment under `nodes/`. Deeper keys are another
        pool's whose prefix lies under this one's (`/team` and `/team/nodes/gpu`): taken by
        their last segment, its nodes joined this pool, and one of them leaving under the
        name of a node of this one removed that live node from every view here."""
        return key.startswith(self._nodes) and b"/" not in key[len(self._nodes):]

    def _on_node_event(self, event) -> None:
        node_id = _text(event.kv.key.rsplit(b"/", 1)[-1])
        rec = self._record(event.kv.key, event.kv.value) if event.kind == "PUT" else None
        if rec is not None:
            joined = node_id not in self.members
            self.members[node_id] = rec
            if joined:
                self._publish(Change.JOINED, node_id)
        elif self.members.pop(node_id, None) is not None:  # gone, or a record not readable
            self._publish(Change.LEFT, node_id)

    async def _on_leader_event(self, event) -> None:
        if event.kind == "PUT" and not event.kv.lease:
            await self._drop_unleased_leader(event.kv.create_revision)
        elif event.kind == "PUT":
            self._set_leader(_text(event.kv.value), event.kv.lease, event.kv.create_revision)
            return
        self._set_leader(None)
        await self._try_lead()

    @property
    def leader_term(self) -> tuple[str | None, int | None]:
        """The current term: (leader id, the lease its key is held under)."""
        return self.leader_id, self._leader_lease

    def _set_leader(self, node_id: str | None, lease: int | None = None,
                    rev: int | None = None) -> None:
        self._leader_rev = rev
        if (node_id, lease) != (self.leader_id, self._leader_lease):
            self.leader_id, self._leader_lease = node_id, lease
            self._publish(Change.LEADER, node_id)

    def _publish(self, change: Change, node_id: str | None) -> None:
        event = MembershipEvent(change, node_id, time.monotonic())
        for q in self._queues:
            q.put_nowait(event)


STOP_STEP_S = 2.0
LEASE_MARGIN_S = 0.1  # how long before its lease's end by this node's clock it stops leading
# (for clocks' rates, which differ by parts per million: the end is already counted from
# before etcd took the refresh, and etcd only ever lets a lease go later than its TTL)


def lease_clock() -> float:
    """Seconds on a clock that runs on while the host is suspended (CLOCK_BOOTTIME; the
    monotonic clock where there is none)."""
    return time.clock_gettime(BOOTTIME) if BOOTTIME is not None else time.monotonic()


BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def _text(raw: bytes) -> str:
    """An etcd key or value as text (one not UTF-8 is no reason to fail)."""
    return raw.decode("utf-8", "replace")


async def _bounded(aw, timeout_s: float) -> None:
    """Await `aw` for at most timeout_s; past that, leave it (the lease then just expires)."""
    try:
        await asyncio.wait_for(aw, timeout_s)
    except asyncio.TimeoutError:
        log.warning("etcd did not answer within %.0f s while leaving; moving on", timeout_s)
