"""`ClusterClient`: the blocking SDK for a pool of `kvtier serve --cluster` nodes.

`kvstore.connect("etcd://HOST:PORT/PREFIX", namespace=ns)` returns one. It follows the
members through etcd (an observer: it never registers), puts each new block on
`replicas` nodes (a preferred node first, when given, then consistent hashing over the
live nodes), and finds blocks through the leader's cluster index, fetching each one
directly from a node that holds it. A node that is down or loses a block turns that block
into a miss (or a replica serves it): never an error for a read, never wrong bytes.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Sequence

from kvstore.buffers import byte_rows
from kvstore.client.errors import ClientError
from kvstore.cluster.membership import Change, ClusterMember
from kvstore.cluster.messages import TENANT_LOCATE_HASHES, Locate, Located, TenantLocate
from kvstore.cluster.records import ClusterError, parse_etcd_url, read_etcd_tls
from kvstore.cluster.ring import HashRing
from kvstore.events import TierKind
from kvstore.keys import Namespace
from kvstore.api import MatchResult, PutStatus
from kvstore.logevery import LogEvery
from kvstore.wire import ErrorCode, RemoteError

log = logging.getLogger("kvtier.cluster")
TENANT_LOCATE = "locate-tenant"  # the leader's route for a namespace's own token
ASK_INDEX_AGAIN_S = 60.0  # a token the leader's index refused asks it again after this

_RANK = {PutStatus.STORED: 0, PutStatus.EXISTS: 1, PutStatus.NO_SPACE: 2}
NODE_ERRORS = (ClientError, RemoteError, ConnectionError, OSError)
# refusals that may be of the caller's own making (a wrong token, a namespace no node
# takes): raised when no node answered at all, for a wrong token had made every put
# NO_SPACE and every read a miss, silently; one node's alone (its own token file or block
# size) is that node's fault, skipped like any other
CALLER_ERRORS = (ErrorCode.AUTH, ErrorCode.FORBIDDEN, ErrorCode.NAMESPACE)
RECENT_PUTS = 1 << 16  # hashes this client put lately, asked of their ring owners too
RECENT_S = 5.0  # (the leader's index lags a put by tens of milliseconds)
_FAILED = object()  # what `ClusterClient._ask` returns for a node that could not answer


class _Calls:
    """What one pool call's node calls came to: whether any node answered, and the first
    refusal that may be the caller's (`CALLER_ERRORS`), raised by `check` when none did."""

    def __init__(self) -> None:
        self.answered, self.refusal = False, None

    def failed(self, e: Exception) -> None:
        if isinstance(e, RemoteError) and e.code in CALLER_ERRORS and self.refusal is None:
            self.refusal = e

    def check(self) -> None:
        if self.refusal is not None and not self.answered:
            raise self.refusal


class _EtcdLoop:
    """The one asyncio loop, on a daemon thread, that every blocking ClusterClient of a
    process talks to etcd from. gRPC's asyncio engine is process-wide and stays bound to
    the loop it started on: with a loop per client, a client whose gRPC channel outlived
    its loop a moment (a busy host) left the engine's poller thread, epoll, eventfd and
    socketpair behind, and its callbacks raising "Event loop is closed"."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid = 0

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():  # (a forked child has no thread)
                cls._loop, cls._pid = asyncio.new_event_loop(), os.getpid()
                threading.Thread(target=cls._loop.run_forever, name="kvtier-etcd",
                                 daemon=True).start()
            return cls._loop


class ClusterClient:
    def __init__(self, url: str, token: str = "", namespace: Namespace | None = None, *,
                 replicas: int = 1, prefer_node: str | None = None, timeout_s: float = 30.0,
                 use_shm: bool = True, etcd_credentials_file: str | None = None,
                 etcd_ca_file: str | None = None, etcd_cert_file: str | None = None,
                 etcd_key_file: str | None = None) -> None:
        if namespace is None:
            raise ValueError("ClusterClient needs namespace=Namespace(...)")
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.ns, self.token, self.replicas, self.prefer_node = namespace, token, replicas, prefer_node
        self.timeout_s, self.use_shm = timeout_s, use_shm
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str], object] = {}
        self._ring, self._ring_nodes = HashRing(), frozenset()
        self._recent: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._refused = LogEvery()  # the leader's refusals to locate (a token's, not a fault's)
        self.index_refused = False  # the leader's index is not this token's (a tenant's)
        self._no_route = False  # the last locate found no such route (an older leader)
        self._ask_again_at = 0.0  # when a refused token asks the index again
        self._refused_by: tuple[str, str] | None = None  # the leader that refused it
        # a leader without the tenant route that answered this (admin's) token by id: asked
        # by id straight away until ASK_INDEX_AGAIN_S on (it may be upgraded meanwhile)
        self._by_id_at: tuple[str, str] | None = None
        self._by_id_until = 0.0
        self._loop = _EtcdLoop.get()
        # (read here, before any thread or channel: a bad file is the caller's ConfigError)
        self._member = ClusterMember(parse_etcd_url(
            url, etcd_credentials_file, read_etcd_tls(etcd_ca_file, etcd_cert_file,
                                                      etcd_key_file)), None)
        try:
            self._on_loop(self._member.start())
        except BaseException:
            try:  # (its etcd channel, if it got one)
                self._on_loop(self._member.stop(graceful=False), timeout_s=10)
            except Exception:  # noqa: BLE001 - the start's own error is the one to raise
                pass
            raise
        self._leaves = asyncio.run_coroutine_threadsafe(self._cut_leavers(), self._loop)

    def _on_loop(self, coro, timeout_s: float = 30.0):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except BaseException:
            future.cancel()  # (the loop is shared: nothing left running on it)
            raise

    async def _cut_leavers(self) -> None:
        """A node that leaves the pool (its lease lapsed: killed, stopped, cut off) has
        its calls in flight cut at once, so they go on to another holder: docs/cluster.md
        promises the TTL bounds how long a dead node is tried. A stopped node had held a
        read for the client's whole timeout_s (30 s)."""
        events = self._member.subscribe()
        while True:
            event = await events.get()
            if event.change is not Change.LEFT or not event.node_id:
                continue
            with self._lock:  # (out of the pool: one that comes back gets a fresh client)
                gone = [k for k in self._clients if k[0] == event.node_id]
                clients = [self._clients.pop(k) for k in gone]
            for client in clients:
                try:
                    client.abort_calls()
                except Exception:  # noqa: BLE001 - the next node that leaves is cut all the same
                    log.exception("cutting the calls to node %s failed", event.node_id)
                threading.Thread(target=client.close, daemon=True,  # (not on this loop:
                                 name="kvtier-close").start()  # it may wait for a call)

    # ------------------------------------------------------------ membership

    def nodes(self) -> dict[str, str]:
        """Live node id -> data-plane address."""
        return {n: r.data_addr for n, r in dict(self._member.members).items()}

    @property
    def leader_id(self) -> str | None:
        return self._member.leader_id

    def _node_client(self, node_id: str):
        """A pooled client for a live node, keyed by its current address (a node that came
        back elsewhere gets a new one)."""
        from kvstore.client.sync import Client
        rec = self._member.members.get(node_id)
        if rec is None:
            raise ClientError(f"node {node_id} is not a live member of the cluster")
        key = (node_id, rec.data_addr)
        with self._lock:
            client = self._clients.get(key)
        if client is not None:
            return client
        try:
            client = Client(f"kvtier://{rec.data_addr}", self.token, self.ns,
                            timeout_s=self.timeout_s, use_shm=self.use_shm)
        except ValueError as e:  # (records are checked as they are read: not expected)
            raise ClientError(f"node {node_id}'s address {rec.data_addr!r}: {e}") from e
        with self._lock:
            stale = [k for k in self._clients if k[0] == node_id and k != key]
            old = [self._clients.pop(k) for k in stale]
            kept = self._clients.setdefault(key, client)
        for c in old + ([client] if kept is not client else []):
            c.close()
        return kept

    def _forget(self, node_id: str) -> None:
        with self._lock:
            gone = [self._clients.pop(k) for k in list(self._clients) if k[0] == node_id]
        for client in gone:
            client.close()

    def _owners(self, h: bytes) -> list[str]:
        live = frozenset(self._member.members)
        if live != self._ring_nodes:
            self._ring, self._ring_nodes = HashRing(sorted(live)), live
        owners = [self.prefer_node] if self.prefer_node in live else []
        for node in self._ring.owners(h, self.replicas + len(owners)):
            if node not in owners and len(owners) < self.replicas:
                owners.append(node)
        return owners

    # ------------------------------------------------------------ the index

    def locate(self, hashes: Sequence[bytes]) -> Located | None:
        """Ask the leader which nodes hold each block; None when no leader answers."""
        leader = self._member.leader_id
        rec = self._member.members.get(leader) if leader else None
        if rec is None or not hashes:
            return None
        leader_key = (rec.node_id, rec.control_url)
        if (self.index_refused and time.monotonic() < self._ask_again_at
                and self._refused_by == leader_key):
            return None  # (refused lately: not a round trip to a 403 before every read; a
            # new leader is asked at once)
        by_id = Locate(self.ns.ns_id, tuple(map(bytes, hashes)))
        if not self.ns.tenant or (self._by_id_at == leader_key
                                  and time.monotonic() < self._by_id_until):
            return self._locate(rec, "locate", by_id)
        # a tenant's namespace goes whole (its token may locate its own), in pieces the
        # leader takes from a tenant (MAX_TENANT_BODY); the pieces' holders make the prefixes
        holders: list[tuple[str, ...]] = []
        for at in range(0, len(hashes), TENANT_LOCATE_HASHES):
            piece = hashes[at:at + TENANT_LOCATE_HASHES]
            got = self._locate(rec, TENANT_LOCATE, TenantLocate.of(self.ns, piece))
            if got is None and self.index_refused and self._no_route:
                # a leader older than the route: an admin's token still locates by id (a
                # tenant's is refused there too, and asks every member)
                got = self._locate(rec, "locate", by_id)
                if got is not None:  # (asked by id from now on: two round trips a locate)
                    self._by_id_at = leader_key
                    self._by_id_until = time.monotonic() + ASK_INDEX_AGAIN_S
                return got
            if got is None:
                return None
            holders += got.holders
        if len(hashes) <= TENANT_LOCATE_HASHES:
            return got
        return Located(tuple(holders), leading_holders(holders))

    def _locate(self, rec, what: str, msg) -> Located | None:
        headers = {"Content-Type": "application/msgpack"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(f"{rec.control_url}/cluster/{what}", method="POST",
                                     data=msg.encode(), headers=headers)
        self._no_route = False
        try:
            with urllib.request.urlopen(req, timeout=min(self.timeout_s, 5.0)) as resp:
                self.index_refused = False
                return Located.decode(resp.read())
        except urllib.error.HTTPError as e:
            self._no_route = e.code in (404, 405)
            if e.code in (429, 503):  # busy, or unable to vouch for its role this moment
                self.index_refused = True  # (see daemon.cluster): this read asks every
                self._ask_again_at = 0.0  # member, the next one the leader again
                return None
            if e.code in (401, 403, 404, 405, 409):  # the index is not this token's (or
                # the leader predates locate-tenant, or cannot vouch that the index of this
                # namespace's id is this namespace's): ask every member instead (`_candidates`);
                # it looked only where the hash ring says, and missed every block put
                # through a preferred node, silently
                self.index_refused = True
                self._ask_again_at = time.monotonic() + ASK_INDEX_AGAIN_S
                self._refused_by = (rec.node_id, rec.control_url)
                skipped = self._refused.due()
                if skipped is not None:
                    log.info("the cluster index is not this token's (HTTP %d from the leader "
                             "%s): reads ask every member (%d more since the last line)",
                             e.code, rec.node_id, skipped)
            return None
        except (urllib.error.URLError, OSError, ClusterError, ValueError):
            return None  # (ValueError: a URL or a reply that is not one)

    def _candidates(self, hashes: Sequence[bytes]) -> list[list[str]]:
        """Per hash, the nodes to try in order: index holders, then ring owners; where no
        index answers (this token's is refused, or the pool has no leader right now), ring
        owners and then every other member. (Without a leader, a reader with fewer
        `replicas` than the writer, or another `prefer_node`, asked only its own ring owners,
        and missed blocks live replicas held.)"""
        located = self.locate(hashes)
        rest = sorted(self._member.members) if located is None else []
        out = []
        for i, h in enumerate(hashes):
            nodes = list(located.holders[i]) if located else []
            nodes += [n for n in self._owners(bytes(h)) if n not in nodes]
            out.append(nodes + [n for n in rest if n not in nodes])
        return out

    # ------------------------------------------------------------ data

    def put_n(self, hashes: Sequence[bytes], srcs) -> list[PutStatus]:
        """Store each block on `replicas` nodes. A block no node could take is NO_SPACE."""
        rows = byte_rows(srcs, len(hashes), self.ns.block_bytes)
        status = [PutStatus.NO_SPACE] * len(hashes)
        groups: dict[str, list[int]] = {}
        for i, h in enumerate(hashes):
            for node in self._owners(bytes(h)):
                groups.setdefault(node, []).append(i)
        calls = _Calls()
        for node, idx in groups.items():
            got = self._ask(node, calls, lambda c: c.put_n([hashes[i] for i in idx],
                                                         [rows[i] for i in idx]))
            if got is _FAILED:
                continue
            for i, st in zip(idx, got):
                status[i] = min(status[i], st, key=_RANK.__getitem__)
        calls.check()
        self._note_puts(hashes)
        return status

    def _note_puts(self, hashes: Sequence[bytes]) -> None:
        """Remember hashes just put (bounded): contains_n and match_prefix ask their ring
        owners too while the leader's index may not list them yet."""
        now = time.monotonic()
        with self._lock:
            for h in hashes:
                self._recent[bytes(h)] = now
                self._recent.move_to_end(bytes(h))
            while len(self._recent) > RECENT_PUTS:
                self._recent.popitem(last=False)

    def _put_lately(self, h: bytes) -> bool:
        with self._lock:
            at = self._recent.get(bytes(h))
        return at is not None and time.monotonic() - at < RECENT_S

    def get_n(self, hashes: Sequence[bytes], dsts) -> list[TierKind | None]:
        """Fetch each block from a node that holds it; None where no live node has it."""
        rows = byte_rows(dsts, len(hashes), self.ns.block_bytes, writable=True)
        out: list[TierKind | None] = [None] * len(hashes)
        todo = {i: c for i, c in enumerate(self._candidates(hashes))}
        calls = _Calls()
        while todo:
            groups: dict[str, list[int]] = {}
            for i, cands in list(todo.items()):
                if not cands:
                    del todo[i]
                else:
                    groups.setdefault(cands.pop(0), []).append(i)
            for node, idx in groups.items():
                for i, tier in zip(idx, self._get_from(node, hashes, rows, idx, calls)):
                    if tier is not None:
                        out[i] = tier
                        todo.pop(i, None)
        calls.check()
        return out

    def _get_from(self, node: str, hashes, rows, idx: list[int],
                  calls: _Calls) -> list[TierKind | None]:
        got = self._ask(node, calls, lambda c: c.get_n([hashes[i] for i in idx],
                                                     [rows[i] for i in idx]))
        return [None] * len(idx) if got is _FAILED else got

    def _ask(self, node: str, calls: _Calls, call):
        """`call(node's client)`, or _FAILED where the node could not answer: it is
        forgotten (the next call connects afresh), and a refusal that may be the caller's
        is noted in `calls`."""
        try:
            got = call(self._node_client(node))
        except NODE_ERRORS as e:
            calls.failed(e)
            self._forget(node)
            return _FAILED
        calls.answered = True
        return got

    def contains_n(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether the pool holds each block: the index's holders, and for a block it
        names none, its ring owners asked (the index lags a put by tens of milliseconds:
        a block just STORED had read as absent)."""
        located = self.locate(hashes)
        if located is not None:
            found = [bool(h) for h in located.holders]
            groups: dict[str, list[int]] = {}
            for i, h in enumerate(hashes):
                if not found[i] and self._put_lately(h):
                    for node in self._owners(bytes(h)):
                        groups.setdefault(node, []).append(i)
            for node, idx in groups.items():  # (what they refuse, the index answered)
                got = self._ask(node, _Calls(), lambda c: c.contains_n([hashes[i] for i in idx]))
                if got is _FAILED:
                    continue
                for i, ok in zip(idx, got):
                    found[i] = found[i] or ok
            return found
        found = [False] * len(hashes)
        calls = _Calls()
        # no index answers: every member asked once, for the whole batch (the ring owners
        # of this reader's `replicas` missed what a writer put elsewhere)
        for node in sorted(self._member.members):
            got = self._ask(node, calls, lambda c: c.contains_n(hashes))
            if got is not _FAILED:
                found = [a or b for a, b in zip(found, got)]
        calls.check()
        return found


    def match_prefix(self, hashes: Sequence[bytes]) -> MatchResult:
        """The longest prefix one node holds, asked of that node itself (the index may lag
        by a few milliseconds); without a leader, every live node is asked."""
        located = self.locate(hashes)
        nodes = [n for n, _ in located.prefix[:2]] if located else sorted(self._member.members)
        whole = bool(located and located.prefix and located.prefix[0][1] >= len(hashes))
        if located is not None and hashes and not whole and self._put_lately(hashes[0]):
            # (put lately: the index may lag it) the first block's ring owners asked too
            nodes += [n for n in self._owners(bytes(hashes[0])) if n not in nodes]
        best, calls = MatchResult(0, ()), _Calls()
        for node in nodes:
            got = self._ask(node, calls, lambda c: c.match_prefix(hashes))
            if got is not _FAILED and got.num_blocks > best.num_blocks:
                best = got
        calls.check()
        return best

    def close(self) -> None:
        self._leaves.cancel()
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        self._on_loop(self._member.stop(), timeout_s=10)

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def leading_holders(holders: Sequence[Sequence[str]]) -> tuple[tuple[str, int], ...]:
    """(node, how many leading blocks it holds), longest first (`Located.prefix` from
    per-block holders)."""
    run: dict[str, int] = {}
    live = set(holders[0]) if holders else set()
    for i, nodes in enumerate(holders):
        live &= set(nodes)
        if not live:
            break
        for n in live:
            run[n] = i + 1
    return tuple(sorted(run.items(), key=lambda p: (-p[1], p[0])))
