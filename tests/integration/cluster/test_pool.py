"""A pool of real `kvtier serve --cluster` processes coordinated by a real etcd server."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import kvstore
from kvstore.client.cluster import ClusterClient
from kvstore.cluster.messages import Located
from kvstore.daemon.process import freeze
from kvstore.wire import AuthError
from kvstore.keys import hash_blocks
from kvstore.store import PutStatus

from ..daemon.conftest import NS, Daemon, block_of

TTL = 2
_pools = itertools.count()


class Pool:
    def __init__(self, etcd, tmp_path, n: int, *extra: str) -> None:
        self.url = etcd.url(f"kvtier-test-pool{next(_pools)}")
        self.extra = extra
        self.tmp_path = tmp_path
        self.nodes = {f"n{i}": self._daemon(f"n{i}") for i in range(n)}
        for d in self.nodes.values():
            d.start()

    def _daemon(self, node_id: str) -> Daemon:
        return Daemon(str(self.tmp_path / node_id), "--cluster", self.url, "--node-id", node_id,
                      "--cluster-ttl", str(TTL), *self.extra)

    def restart(self, node_id: str) -> Daemon:
        old = self.nodes[node_id]
        d = Daemon(old.data_dir, *old.extra)
        self.nodes[node_id] = d.start()
        return d

    def view(self, node_id: str, token: str = "") -> dict:
        """The node's /cluster/nodes, or {} until it has joined (404) or while it can't answer."""
        try:
            return self.nodes[node_id].get_json("/cluster/nodes", token)
        except (urllib.error.HTTPError, OSError):
            return {}

    def stop(self) -> None:
        for d in self.nodes.values():
            d.close()


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds it took; fails the test with `what` after timeout_s."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


def chain(seed: int, n: int) -> list[bytes]:
    return hash_blocks(NS, list(range(seed * 100_000, seed * 100_000 + n * NS.block_tokens)))


def payload(hashes) -> np.ndarray:
    return np.stack([block_of(h, NS.block_bytes) for h in hashes])


def check_bytes(hashes, out, tiers) -> int:
    """Every hit byte-exact; returns the number of hits."""
    for h, row, t in zip(hashes, out, tiers):
        if t is not None:
            assert np.array_equal(row, block_of(h, NS.block_bytes)), "wrong bytes from the pool"
    return sum(t is not None for t in tiers)


def indexed(client, hashes) -> bool:
    """Does the leader's index list a holder for every block? (contains_n also asks the
    ring owners, so it answers before the index has caught up.)"""
    located = client.locate(hashes)
    return located is not None and all(located.holders)


def read(client, hashes):
    out = np.zeros((len(hashes), NS.block_bytes), np.uint8)
    tiers = client.get_n(hashes, out)
    return out, tiers


class Reader:
    """Reads `hashes` in a loop on a thread (its own client) until stopped, counting
    rounds, hits, wrong bytes and exceptions: load during a fault."""

    def __init__(self, url: str, hashes: list[bytes]) -> None:
        self.url, self.hashes = url, hashes
        self.rounds = self.hits = self.wrong = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with ClusterClient(self.url, namespace=NS, timeout_s=5.0) as c:
            while not self._stop.is_set():
                try:
                    out, tiers = read(c, self.hashes)
                except Exception as e:  # any exception is a failed request: reported below
                    self.errors.append(repr(e))
                    continue
                for h, row, t in zip(self.hashes, out, tiers):
                    if t is not None:
                        self.hits += 1
                        self.wrong += not np.array_equal(row, block_of(h, NS.block_bytes))
                self.rounds += 1

    def stop(self) -> "Reader":
        self._stop.set()
        self._thread.join(30)
        return self


@pytest.fixture(scope="module")
def pool(etcd, tmp_path_factory):
    """Three nodes, every one of which sees the other two (a test run alone, or first on
    its worker, met a pool whose last node had not registered yet)."""
    p = Pool(etcd, tmp_path_factory.mktemp("pool"), 3)
    try:
        wait_until(lambda: all(len(p.view(n).get("members", ())) == 3 for n in p.nodes), 30,
                   "every node sees three members")
        yield p
    finally:
        p.stop()


def test_nodes_join_and_agree_on_a_leader(pool):
    wait_until(lambda: all(len(pool.view(n).get("members", ())) == 3 for n in pool.nodes), 15,
               "every node sees three members")
    leaders = {pool.view(n)["leader"] for n in pool.nodes}
    assert len(leaders) == 1 and leaders <= set(pool.nodes)


def test_blocks_spread_over_the_nodes_and_all_come_back(pool):
    with kvstore.connect(pool.url, namespace=NS) as c:
        assert isinstance(c, ClusterClient) and set(c.nodes()) == set(pool.nodes)
        hashes = chain(1, 60)
        assert c.put_n(hashes, payload(hashes)) == [PutStatus.STORED] * 60
        out, tiers = read(c, hashes)
        assert check_bytes(hashes, out, tiers) == 60
        wait_until(lambda: indexed(c, hashes), 10, "the leader's index lists every block")
        located = c.locate(hashes)
        assert len({h[0] for h in located.holders}) == 3, "consistent hashing used every node"
        assert c.put_n(hashes[:3], payload(hashes[:3])) == [PutStatus.EXISTS] * 3


def test_a_prefix_put_on_one_node_is_matched_in_full(pool):
    with ClusterClient(pool.url, namespace=NS, prefer_node="n1") as c:
        hashes = chain(2, 12)
        c.put_n(hashes, payload(hashes))
        wait_until(lambda: c.locate(hashes).prefix[:1] == (("n1", 12),), 10,
                   "the index gives n1 the whole prefix")
        m = c.match_prefix(hashes + chain(3, 2))
        assert m.num_blocks == 12 and len(m.tiers) == 12
        assert c.match_prefix(chain(4, 3)).num_blocks == 0


def test_a_cleared_namespace_leaves_the_index_and_its_next_store_is_reported_whole(pool):
    """Cleared on a node, a namespace's blocks leave the leader's index; opened again, its
    new store is reported from its first block (its events are numbered from the start
    again: the cursor of the cleared store skipped as many of them, and those blocks were
    never in the index)."""
    ns = dataclasses.replace(NS, model="cleared-in-a-pool")
    with ClusterClient(pool.url, namespace=ns, prefer_node="n2") as c:
        def held_by_n2(hashes):
            return [h == ("n2",) for h in c.locate(hashes).holders]

        wait_until(lambda: "n2" in c.nodes(), 15, "the client sees n2 (else it puts elsewhere)")
        old = chain(7, 2)
        assert c.put_n(old, payload(old)) == [PutStatus.STORED] * 2
        wait_until(lambda: all(held_by_n2(old)), 10, "the index lists n2's blocks")
        urllib.request.urlopen(urllib.request.Request(
            f"{pool.nodes['n2'].http}/admin/namespaces/{ns.ns_id:016x}/clear", method="POST"))
        wait_until(lambda: not any(held_by_n2(old)), 10, "the cleared blocks left the index")
        batches = [chain(8 + i, 1) for i in range(4)]
        with kvstore.Client(pool.nodes["n2"].url, namespace=ns) as direct:
            for batch in batches:  # four events in a row, within one report interval
                assert direct.put_n(batch, payload(batch)) == [PutStatus.STORED]
        new = [h for batch in batches for h in batch]
        wait_until(lambda: all(held_by_n2(new)), 10, "every block of the new store is listed")


def test_a_report_body_that_trickles_in_is_cut_off(pool):
    """A report to the leader whose body stops coming (its head and 5 of 1000 bytes sent)
    is answered 408 and closed once its deadline (10 s plus its length at 4 MiB/s) has
    passed: it held one of the control plane's 128 connections for as long as its sender
    liked. The leader serves on."""
    import socket
    leader = pool.view("n0")["leader"]
    http = pool.nodes[leader].http
    host, port = http.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /cluster/events HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                  b"Content-Type: application/msgpack\r\n\r\nabcde")
        t0 = time.monotonic()
        reply = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        waited = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert 9 < waited < 25
    with urllib.request.urlopen(http + "/healthz", timeout=10) as r:
        assert r.status == 200


def test_a_lost_node_turns_its_blocks_into_misses_and_replicas_serve(etcd, tmp_path):
    pool = Pool(etcd, tmp_path, 3)
    try:
        with ClusterClient(pool.url, namespace=NS) as single, \
                ClusterClient(pool.url, namespace=NS, replicas=2) as double:
            wait_until(lambda: len(single.nodes()) == 3, 15, "three members")
            one, two = chain(5, 40), chain(6, 40)
            single.put_n(one, payload(one))
            double.put_n(two, payload(two))
            wait_until(lambda: indexed(single, one + two), 10, "index converged")
            victim = next(n for n in pool.nodes if n != single.leader_id)
            lost = [h for h, hs in zip(one, single.locate(one).holders) if hs == (victim,)]
            assert lost, "the victim held some single-copy blocks"
            load = Reader(pool.url, one)
            wait_until(lambda: load.rounds >= 2, 20, "reads under way")
            pool.nodes[victim].kill()                      # SIGKILL while reads are in flight
            time.sleep(0.5)
            load.stop()
            assert load.errors == [] and load.wrong == 0, (load.errors[:3], load.wrong)
            out, tiers = read(single, one)                 # answered: hits and misses only
            assert check_bytes(one, out, tiers) == 40 - len(lost)
            assert all(tiers[one.index(h)] is None for h in lost)
            out, tiers = read(double, two)
            assert check_bytes(two, out, tiers) == 40     # every block has a live replica
            took = wait_until(lambda: victim not in single.nodes(), 4 * TTL + 5,
                              "the dead node leaves the membership")
            print(f"node loss seen by clients after {took:.2f} s (lease TTL {TTL} s)")
            wait_until(lambda: all(victim not in hs for hs in single.locate(one).holders), 5,
                       "the dead node leaves the index")
    finally:
        pool.stop()


def test_a_stopped_nodes_calls_are_cut_once_it_leaves_the_pool(etcd, tmp_path):
    """A node stopped (SIGSTOP) mid-pool answers nothing but keeps its sockets: a read of
    blocks it holds ends (they are misses: no replica here; over TCP, as from another host)
    once its lease lapses and it
    leaves the pool, not after the client's timeout_s (30 s here: it had waited all of it,
    and its retry as long again)."""
    import signal
    pool = Pool(etcd, tmp_path, 2)
    try:
        with ClusterClient(pool.url, namespace=NS, timeout_s=30.0, use_shm=False) as c:
            wait_until(lambda: len(c.nodes()) == 2, 15, "two members")
            hashes = chain(8, 30)
            c.put_n(hashes, payload(hashes))
            wait_until(lambda: indexed(c, hashes), 10, "index converged")
            victim = next(n for n in pool.nodes if n != c.leader_id)
            lost = [h for h, hs in zip(hashes, c.locate(hashes).holders) if hs == (victim,)]
            assert lost, "the victim holds some of the blocks"
            freeze(pool.nodes[victim].proc.pid)  # (every thread: see freeze)
            try:
                t0 = time.monotonic()
                out, tiers = read(c, hashes)
                took = time.monotonic() - t0
                assert check_bytes(hashes, out, tiers) == 30 - len(lost)
                assert took < 4 * TTL + 10, f"a read waited {took:.1f} s on a stopped node"
            finally:
                os.kill(pool.nodes[victim].proc.pid, signal.SIGCONT)
    finally:
        pool.stop()


def test_without_an_index_a_reader_finds_blocks_its_ring_does_not_name(etcd, tmp_path):
    """While no leader answers (one failing over), a reader asked only its own ring owners:
    with fewer `replicas` than the writer's, or another `prefer_node`, it missed blocks
    live nodes held. It asks every member after them now, and contains_n likewise."""
    pool = Pool(etcd, tmp_path, 3)
    try:
        with ClusterClient(pool.url, namespace=NS, replicas=2) as writer, \
                ClusterClient(pool.url, namespace=NS, prefer_node="n2") as preferring, \
                ClusterClient(pool.url, namespace=NS) as reader:
            wait_until(lambda: len(reader.nodes()) == 3, 15, "three members")
            two, pref = chain(7, 30), chain(8, 30)
            writer.put_n(two, payload(two))
            preferring.put_n(pref, payload(pref))
            reader.locate = lambda hashes: None  # (as while no leader answers)
            for hs in (two, pref):
                assert check_bytes(hs, *read(reader, hs)) == 30
                assert reader.contains_n(hs) == [True] * 30
    finally:
        pool.stop()


def test_a_node_others_cannot_reach_never_leads(etcd, tmp_path):
    """A node whose --advertise named an address nobody reaches (itself included) won the
    election when it started first, and the pool had no index for as long as it lived:
    no node could report to it, no client locate through it."""
    pool = Pool(etcd, tmp_path, 0)
    try:
        bad = pool._daemon("bad")
        bad.extra = (*bad.extra, "--advertise", "127.0.0.2")  # (loopback; nothing listens)
        pool.nodes["bad"] = bad.start()
        for n in ("n0", "n1"):
            pool.nodes[n] = pool._daemon(n).start()
        wait_until(lambda: pool.view("n0").get("leader") in ("n0", "n1"), 15, "a reachable leader")
        assert "never leads" in bad.output()
        with ClusterClient(pool.url, namespace=NS, prefer_node="n1") as writer, \
                ClusterClient(pool.url, namespace=NS) as reader:
            wait_until(lambda: len(writer.nodes()) == len(reader.nodes()) == 3, 15,
                       "three members")
            hs = chain(9, 20)
            assert writer.put_n(hs, payload(hs)) == [PutStatus.STORED] * 20
            wait_until(lambda: indexed(reader, hs), 10, "the index")
            assert all(h == ("n1",) for h in reader.locate(hs).holders)
    finally:
        pool.stop()


def test_leader_failover_and_index_convergence(etcd, tmp_path):
    pool = Pool(etcd, tmp_path, 3)
    try:
        with ClusterClient(pool.url, namespace=NS) as c:
            wait_until(lambda: len(c.nodes()) == 3 and c.leader_id, 15, "three members, a leader")
            hashes = chain(7, 30)
            c.put_n(hashes, payload(hashes))
            wait_until(lambda: indexed(c, hashes), 10, "index converged")
            old = c.leader_id
            survivors = {h for h, hs in zip(hashes, c.locate(hashes).holders) if old not in hs}
            load = Reader(pool.url, hashes)
            wait_until(lambda: load.rounds >= 2, 20, "reads under way")
            t0 = time.monotonic()
            pool.nodes[old].kill()                         # the leader, under load
            wait_until(lambda: c.leader_id not in (None, old), 4 * TTL + 5, "a new leader")
            failover = time.monotonic() - t0
            wait_until(lambda: indexed(c, list(survivors)), 10,
                       "the new leader's index holds every surviving block")
            converged = time.monotonic() - t0
            print(f"leader failover {failover:.2f} s, index converged {converged:.2f} s "
                  f"after the kill (lease TTL {TTL} s)")
            load.stop()
            assert load.errors == [] and load.wrong == 0, (load.errors[:3], load.wrong)
            assert load.rounds > 2
            for node_id, d in pool.nodes.items():
                if node_id != old:
                    assert all(n["open_reservations"] == 0 for n in d.get_json("/stats")["namespaces"])
            out, tiers = read(c, hashes)
            assert check_bytes(hashes, out, tiers) == len(survivors)
    finally:
        pool.stop()


def test_a_restarted_node_rejoins_and_reports_its_blocks(etcd, tmp_path):
    pool = Pool(etcd, tmp_path, 2)
    try:
        with ClusterClient(pool.url, namespace=NS, prefer_node="n1") as c:
            wait_until(lambda: len(c.nodes()) == 2, 15, "two members")
            hashes = chain(8, 20)
            c.put_n(hashes, payload(hashes))
            wait_until(lambda: c.locate(hashes).prefix[:1] == (("n1", 20),), 10, "indexed")
            assert pool.nodes["n1"].stop() == 0             # SIGTERM: flush DRAM to SSD
            wait_until(lambda: "n1" not in c.nodes(), 10, "n1 left")
            assert c.match_prefix(hashes).num_blocks == 0
            pool.restart("n1")
            took = wait_until(lambda: c.locate(hashes) is not None
                              and c.locate(hashes).prefix[:1] == (("n1", 20),), 15,
                              "n1's blocks are back in the index")
            print(f"index converged {took:.2f} s after n1 came back")
            out, tiers = read(c, hashes)
            assert check_bytes(hashes, out, tiers) == 20
    finally:
        pool.stop()


def test_a_member_record_no_client_can_reach_is_skipped(pool):
    """A record in etcd whose data address is not HOST:PORT (written by hand, or by a node
    of an older build): the pool's clients skip it. Every pool client's put_n and get_n had
    raised ValueError on it."""
    import asyncio

    import aetcd
    import msgspec
    from kvstore.cluster.records import parse_etcd_url
    addr = parse_etcd_url(pool.url)
    key = f"{addr.prefix}/nodes/forged".encode()
    raw = msgspec.msgpack.encode(["node/2", "forged", "127.0.0.1:notaport",
                                  "http://127.0.0.1:1", b"", time.time()])

    async def etcd_call(op):
        async with aetcd.Client(*addr.endpoints[0]) as client:
            await op(client)
    asyncio.run(etcd_call(lambda c: c.put(key, raw)))
    try:
        with ClusterClient(pool.url, namespace=NS, timeout_s=5.0) as c:
            assert "forged" not in c.nodes() and len(c.nodes()) == 3
            hashes = chain(11, 24)
            assert set(c.put_n(hashes, payload(hashes))) <= {PutStatus.STORED, PutStatus.EXISTS}
            out, tiers = read(c, hashes)
            assert check_bytes(hashes, out, tiers) == 24
    finally:
        asyncio.run(etcd_call(lambda c: c.delete(key)))


def test_a_block_just_stored_is_found_at_once(pool):
    """contains_n and match_prefix right after put_n said STORED: the leader's index lags
    the put by tens of milliseconds, and both had taken its "no holder" for an answer (a
    prefix just stored through a preferred node read as absent)."""
    for k, prefer in enumerate((None, "n1", "n2")):
        with ClusterClient(pool.url, namespace=NS, prefer_node=prefer) as c:
            hashes = chain(13 + k, 8)
            assert set(c.put_n(hashes, payload(hashes))) <= {PutStatus.STORED, PutStatus.EXISTS}
            assert c.contains_n(hashes) == [True] * 8
            if prefer is not None:  # (all on one node: without one, the ring spreads them)
                assert c.match_prefix(hashes).num_blocks == 8


def test_one_node_that_refuses_the_namespace_leaves_the_others_serving(etcd, tmp_path):
    """A node that refuses the namespace (its own --block-tokens here; its own token file
    in a rotation) is that node's fault: its blocks are NO_SPACE and misses, the others'
    are served. Raising on every refusal had taken the whole pool down for every client;
    only a refusal from every node is raised (a wrong token: see below)."""
    pool = Pool(etcd, tmp_path, 1)
    odd = Daemon(str(tmp_path / "odd"), "--cluster", pool.url, "--node-id", "odd",
                 "--cluster-ttl", str(TTL), "--block-tokens", str(2 * NS.block_tokens))
    pool.nodes["odd"] = odd.start()
    try:
        with ClusterClient(pool.url, namespace=NS) as c:
            wait_until(lambda: len(c.nodes()) == 2, 15, "two members")
            hashes = chain(21, 40)
            status = c.put_n(hashes, payload(hashes))
            stored = [h for h, st in zip(hashes, status) if st is PutStatus.STORED]
            assert stored and len(stored) < 40, status  # the ring gave both nodes some
            out, tiers = read(c, hashes)
            assert check_bytes(hashes, out, tiers) == len(stored)
            assert sum(c.contains_n(hashes)) <= len(stored)
            c.match_prefix(hashes)  # (answered, not raised)
    finally:
        pool.stop()


def test_a_pool_client_leaves_no_descriptors_behind(pool):
    """Each ClusterClient had left its event loop's epoll descriptor and wake-up socketpair
    open after close(): a process opening one per job ran out of descriptors. gRPC closes
    a channel's socket, and its engine's epoll set, on threads of its own a moment after
    close(): on a busy host they are given the moment (the leak was for good), and the
    clients share one loop, so its callbacks never meet a closed one."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))
    with ClusterClient(pool.url, namespace=NS):
        pass
    before = fds()
    for _ in range(5):
        with ClusterClient(pool.url, namespace=NS) as c:
            c.contains_n(chain(12, 2))
    wait_until(lambda: fds() <= before + 2, 10, f"no more than {before + 2} descriptors")
    assert [t.name for t in threading.enumerate()].count("kvtier-etcd") == 1


def test_peers_and_clients_need_the_token(etcd, tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text("s3cret\nalice-token alice\n")
    pool = Pool(etcd, tmp_path, 2, "--token-file", str(token_file))
    try:
        wait_until(lambda: len(pool.view("n0", "s3cret").get("members", ())) == 2, 15, "two members")
        req = urllib.request.Request(pool.nodes["n0"].http + "/cluster/events", data=b"x",
                                     method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 401
        with ClusterClient(pool.url, token="s3cret", namespace=NS) as c:
            hashes = chain(9, 10)
            assert c.put_n(hashes, payload(hashes)) == [PutStatus.STORED] * 10
            wait_until(lambda: indexed(c, hashes), 10, "the index works with auth on")
        with ClusterClient(pool.url, token="wrong", namespace=NS) as bad:
            # said, as by a one-node Client (every put had been NO_SPACE, every read a
            # miss, and the caller never told why)
            with pytest.raises(AuthError):
                bad.put_n(hashes, payload(hashes))
            with pytest.raises(AuthError):
                read(bad, hashes)
        # the leader's index (every namespace's id, where its blocks are) is the admin's:
        # a tenant's token sees the members only
        leader = pool.view("n0", "s3cret")["leader"]
        assert pool.view(leader, "s3cret")["index"]
        tenant_view = pool.view(leader, "alice-token")
        assert tenant_view["members"] and tenant_view["index"] is None
    finally:
        pool.stop()


def test_a_tenants_pool_client_finds_blocks_put_through_a_preferred_node(etcd, tmp_path, monkeypatch):
    """A tenant's pool client locates its own namespace through the leader's index (the
    namespace whole, checked against its token): blocks another client of the tenant put
    through a preferred node are hits, and a miss asks only the ring's owners (it asked
    every member, a round trip each). /cluster/locate by namespace id stays the admin's;
    against a leader without the tenant route, a client asks every member."""
    import http.client

    import kvstore.client.cluster as cluster_client
    from kvstore.cluster.messages import Locate, TenantLocate
    from kvstore.keys import Namespace
    token_file = tmp_path / "tokens"
    token_file.write_text("s3cret\nalice-token alice\nbob-token bob\n")
    pool = Pool(etcd, tmp_path, 3, "--token-file", str(token_file))
    alice = Namespace(NS.model, NS.num_layers, NS.num_kv_heads, NS.head_dim, tenant="alice")
    bob = Namespace(NS.model, NS.num_layers, NS.num_kv_heads, NS.head_dim, tenant="bob")
    try:
        wait_until(lambda: len(pool.view("n0", "s3cret").get("members", ())) == 3, 15,
                   "three members")
        hashes = hash_blocks(alice, list(range(30 * alice.block_tokens)))
        with ClusterClient(pool.url, token="alice-token", namespace=alice,
                           prefer_node="n1") as writer:
            assert writer.put_n(hashes, payload(hashes)) == [PutStatus.STORED] * 30
        # (in pieces of 7 hashes, as a batch past the leader's cap for tenants goes)
        monkeypatch.setattr(cluster_client, "TENANT_LOCATE_HASHES", 7)
        with ClusterClient(pool.url, token="alice-token", namespace=alice) as reader:
            wait_until(lambda: (reader.locate(hashes) or Located((), ())).holders
                       and all(reader.locate(hashes).holders), 15, "the leader's index")
            assert not reader.index_refused
            whole = reader.locate(hashes)
            assert len(whole.holders) == 30 and whole.prefix[0][1] == 30
            assert reader.contains_n(hashes) == [True] * 30
            assert check_bytes(hashes, *read(reader, hashes)) == 30
            asked: list[tuple[str, int]] = []
            real_get = reader._get_from

            def counted(node, hs, rows, idx, calls):  # (the real call, its node counted)
                asked.extend((node, i) for i in idx)
                return real_get(node, hs, rows, idx, calls)
            reader._get_from = counted
            missing = hash_blocks(alice, list(range(10**6, 10**6 + 8 * alice.block_tokens)))
            assert read(reader, missing)[1] == [None] * 8
            per_miss = collections.Counter(i for _, i in asked)
            assert max(per_miss.values()) <= reader.replicas, asked  # (not every member)
        leader = pool.nodes[pool.view("n0", "s3cret")["leader"]]

        def post(path, body, token="alice-token", length=None):
            conn = http.client.HTTPConnection(leader.http.split("//")[1], timeout=10)
            headers = {"Content-Type": "application/msgpack",
                       "Content-Length": str(len(body) if length is None else length)}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            conn.request("POST", path, body=body, headers=headers)
            status = conn.getresponse().status
            conn.close()
            return status
        mine = TenantLocate.of(alice, hashes[:3]).encode()
        assert post("/cluster/locate-tenant", mine) == 200
        assert post("/cluster/locate-tenant", TenantLocate.of(bob, hashes[:3]).encode()) == 403
        assert post("/cluster/locate-tenant", mine, token="bob-token") == 403
        assert post("/cluster/locate-tenant", mine, token="") == 401
        assert post("/cluster/locate-tenant", mine, token="s3cret") == 200  # (the admin's: any)
        bad = TenantLocate("m", 1, 1, 64, "bogus", 16, "main", "alice", "raw", ()).encode()
        assert post("/cluster/locate-tenant", bad) == 400
        # a tenant's body is small and announced: refused before a byte of it is read
        assert post("/cluster/locate-tenant", b"", length=64 << 20) == 413
        conn = http.client.HTTPConnection(leader.http.split("//")[1], timeout=10)
        conn.request("POST", "/cluster/locate-tenant", body=iter([mine]), encode_chunked=True,
                     headers={"Authorization": "Bearer alice-token"})
        assert conn.getresponse().status == 413  # (no length said)
        conn.close()
        many = TenantLocate.of(alice, [hashes[0]] * 9000).encode()
        assert post("/cluster/locate-tenant", many) == 413
        # a few locates at once per token: one whose body never comes holds a slot a
        # moment (TENANT_BODY_GRACE_S), and past TENANT_LOCATES the rest are turned away
        import socket
        host, port = leader.http.split("//")[1].split(":")
        held = []
        for _ in range(4):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"POST /cluster/locate-tenant HTTP/1.1\r\nHost: x\r\n"
                      b"Authorization: Bearer alice-token\r\nContent-Length: 100\r\n\r\n")
            held.append(s)
        try:
            statuses = set()
            deadline = time.monotonic() + 1.5
            while 429 not in statuses and time.monotonic() < deadline:
                statuses.add(post("/cluster/locate-tenant", mine))
            assert 429 in statuses
            assert post("/cluster/locate-tenant", mine, token="bob-token") != 429  # (per token)
        finally:
            for s in held:
                s.close()
        wait_until(lambda: post("/cluster/locate-tenant", mine) == 200, 10, "slots back")
        # the index by namespace id stays the admin's
        assert post("/cluster/locate", Locate(alice.ns_id, tuple(hashes[:3])).encode()) == 403
        # two namespaces naming one id in the index (ids collide, or a node lies): a tenant
        # is told nothing of the index by id alone, and its client asks every member (a
        # member names the other root: one that is no member speaks for nothing)
        from kvstore.cluster.messages import NamespaceRoot
        other_root = bytes(alice.root_hash)[:8] + b"\x00" * 8

        def n2_names_another_root() -> bool:  # (n2's own first report of the namespace,
            # opened there by the reads above, can land just after and name its real root:
            # a node names one root an id, the last; it reports it once)
            assert post("/cluster/namespace", NamespaceRoot("n2", alice.ns_id, other_root)
                        .encode(), token="s3cret") == 200
            return post("/cluster/locate-tenant", mine) == 409
        wait_until(n2_names_another_root, 10, "a tenant's locate refused: two roots, one id")
        assert post("/cluster/namespace", NamespaceRoot("n9", alice.ns_id, b"\x01" * 16).encode(),
                    token="s3cret") == 400  # (a root that is not of that id)
        assert post("/cluster/namespace", NamespaceRoot("n9", alice.ns_id, other_root).encode()) == 403
        assert post("/cluster/locate-tenant", mine) == 409
        with ClusterClient(pool.url, token="alice-token", namespace=alice) as reader:
            assert check_bytes(hashes, *read(reader, hashes)) == 30
            assert reader.index_refused
        # a leader that predates the tenant route: every member is asked, nothing is missed
        monkeypatch.setattr(cluster_client, "TENANT_LOCATE", "locate-from-the-future")
        with ClusterClient(pool.url, token="alice-token", namespace=alice) as reader:
            assert check_bytes(hashes, *read(reader, hashes)) == 30
            assert reader.index_refused
        # an admin's client there locates by id: after the first refusal, in one round trip
        with ClusterClient(pool.url, token="s3cret", namespace=alice) as admin:
            routes = []
            real_locate = admin._locate

            def noted(rec, what, msg):
                routes.append(what)
                return real_locate(rec, what, msg)
            admin._locate = noted
            for _ in range(3):
                assert check_bytes(hashes, *read(admin, hashes)) == 30
            assert not admin.index_refused
            assert routes == ["locate-from-the-future", "locate", "locate", "locate"], routes
    finally:
        pool.stop()


def test_a_namespace_of_many_blocks_reaches_the_leaders_index_after_a_restart(etcd, tmp_path):
    """A restarted node reports each namespace as one snapshot, 18 bytes a block: past
    ~58k blocks the leader's HTTP body limit (aiohttp's 1 MiB) answered 413, for good, and
    that node's blocks never reached the index (the node resent the snapshot every 50 ms)."""
    from kvstore.keys import Namespace
    from kvstore.client import Client
    tiny = Namespace("tiny", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
    d = Daemon(str(tmp_path / "n0"), "--cluster", etcd.url("kvtier-test-big"), "--node-id",
               "n0", "--cluster-ttl", str(TTL), dram_size="4MiB", ssd_size="16MiB").start()
    try:
        hs = hash_blocks(tiny, np.arange(70_000))
        with Client(d.url, namespace=tiny, use_shm=False) as c:
            for i in range(0, len(hs), 8192):
                part = hs[i:i + 8192]
                assert PutStatus.NO_SPACE not in c.put_n(part, np.ones((len(part), 4), np.uint8))
        d.stop()
        d.start()  # the namespace reopens from SSD: one snapshot of 70,000 blocks
        with Client(d.url, namespace=tiny, use_shm=False) as c:
            assert c.contains_n(hs[:1]) == [True]  # (opens the namespace)
        def index() -> dict:
            try:  # (404 until the node has joined)
                nodes = d.get_json("/cluster/nodes")
            except (urllib.error.HTTPError, OSError):
                return {}
            return (nodes.get("index") or {}).get(f"{tiny.ns_id:016x}", {})
        wait_until(lambda: index().get("nodes") == ["n0"], 20, "the snapshot reached the index")
        assert "answered 413" not in d.output()
    finally:
        d.close()


def test_a_pool_on_an_etcd_with_auth_on(tmp_path):
    """Without etcd's auth anyone who reaches it can rewrite the pool's membership (send
    clients to a node of theirs). With it on, nodes and pool clients log in with a user
    whose role may read and write the pool's prefix alone (`--etcd-credentials-file`,
    `etcd_credentials_file=`): the pool forms and serves. A node with no credentials or a
    wrong password is refused at start with a clear error, and so is a pool client; a
    credentials file others may read, and a password in the URL, are refused outright."""
    import subprocess

    from kvstore.cluster.etcdproc import EtcdProcess
    from kvstore.cluster.records import ClusterError
    from kvstore.errors import ConfigError

    with EtcdProcess(str(tmp_path / "etcd"), name="kvtier-auth") as etcd:
        def ctl(*args: str) -> None:
            subprocess.run(["etcdctl", "--endpoints", etcd.endpoint, *args], check=True,
                           capture_output=True, timeout=30)
        ctl("user", "add", "root", "--new-user-password=rootpw")
        ctl("role", "add", "pool")  # (Pool names its prefixes /kvtier-test-poolN)
        ctl("role", "grant-permission", "pool", "readwrite", "/kvtier-test-pool", "--prefix=true")
        ctl("user", "add", "node", "--new-user-password=nodepw")
        ctl("user", "grant-role", "node", "pool")
        ctl("auth", "enable")
        creds, wrong = tmp_path / "etcd-creds", tmp_path / "etcd-wrong"
        for path, line in ((creds, "node:nodepw\n"), (wrong, "# the pool's\nnode:nope\n")):
            path.write_text(line)
            path.chmod(0o600)

        pool = Pool(etcd, tmp_path / "pool", 2, "--etcd-credentials-file", str(creds))
        try:
            wait_until(lambda: all(len(pool.view(n).get("members", ())) == 2 for n in pool.nodes),
                       30, "two members, logged in to etcd")
            with ClusterClient(pool.url, namespace=NS, etcd_credentials_file=str(creds)) as c:
                hashes = chain(31, 6)
                assert c.put_n(hashes, payload(hashes)) == [PutStatus.STORED] * 6
                out, tiers = read(c, hashes)
                assert check_bytes(hashes, out, tiers) == 6
            for file in (None, wrong):
                with pytest.raises(ClusterError, match="requires a user" if file is None
                                   else "refused user 'node'"):
                    ClusterClient(pool.url, namespace=NS,
                                  etcd_credentials_file=None if file is None else str(file))
                extra = () if file is None else ("--etcd-credentials-file", str(file))
                stranger = Daemon(str(tmp_path / "stranger"), "--cluster", pool.url,
                                  "--node-id", "x", *extra)
                try:  # (it may answer /healthz a moment before it tries etcd)
                    stranger.start(timeout_s=30)
                except RuntimeError:
                    pass
                assert stranger.proc.wait(30) != 0
                assert ("requires a user" if file is None else "refused user 'node'") \
                    in stranger.output(), stranger.output()
                stranger.close()
            assert len(pool.view("n0").get("members", ())) == 2  # (neither got in)
        finally:
            pool.stop()
    creds.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        ClusterClient("etcd://127.0.0.1:1/x", namespace=NS, etcd_credentials_file=str(creds))
    loose = Daemon(str(tmp_path / "loose"), "--cluster", "etcd://127.0.0.1:1/x",
                   "--etcd-credentials-file", str(creds))
    with pytest.raises(RuntimeError, match="chmod 600"):  # (before it opens a port)
        loose.start(timeout_s=30)
    loose.close()
    with pytest.raises(ConfigError, match="do not go in the cluster address"):
        ClusterClient("etcd://node:nodepw@127.0.0.1:1/x", namespace=NS)
