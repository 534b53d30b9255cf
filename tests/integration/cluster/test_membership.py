"""Membership and leader election against a real etcd server."""
import asyncio
import itertools
import time

import aetcd
import msgspec
import pytest

from kvstore.cluster.membership import Change, ClusterMember
from kvstore.cluster.records import ClusterError, NodeRecord, parse_etcd_url
from kvstore.errors import ConfigError

TTL = 2
_prefixes = itertools.count()


def address(etcd):
    # a fresh key prefix per test so tests never see each other's nodes
    return parse_etcd_url(etcd.url(f"kvtier-test-{next(_prefixes)}"))


def member(addr, name, **kw):
    rec = NodeRecord(name, f"127.0.0.1:{9000 + len(name)}", "http://127.0.0.1:1", b"meta-" + name.encode())
    return ClusterMember(addr, rec, ttl_s=TTL, **kw)


def test_parse_etcd_url():
    a = parse_etcd_url("etcd://10.0.0.1:2379,h2:2380/pool")
    assert a.endpoints == (("10.0.0.1", 2379), ("h2", 2380)) and a.prefix == "/pool"
    assert parse_etcd_url("etcd://h:1").prefix == "/kvtier"
    for bad in ("http://h:1", "etcd://h", "etcd://:5"):
        with pytest.raises(ConfigError):
            parse_etcd_url(bad)


def test_records_roundtrip_and_refuse_garbage():
    rec = NodeRecord("n1", "127.0.0.1:5", "http://127.0.0.1:6", b"\x00\x01")
    assert NodeRecord.decode(rec.encode()) == rec
    assert NodeRecord("n6", "[::1]:5", "https://[::1]:6").data_addr == "[::1]:5"
    with pytest.raises(ClusterError):
        NodeRecord.decode(b"\xc1garbage")
    # addresses no client could connect to (one of them in the pool had made every pool
    # client's put_n and get_n raise ValueError): refused as the record is made or read
    for data, control in (("127.0.0.1:notaport", "http://127.0.0.1:6"),
                          ("[127.0.0.1:5555]:7481", "http://127.0.0.1:6"),
                          ("127.0.0.1", "http://127.0.0.1:6"), ("127.0.0.1:0", "http://h:6"),
                          ("127.0.0.1:5/x", "http://h:6"), ("127.0.0.1:5", "ftp://h:6"),
                          ("127.0.0.1:5", "http://h"), ("127.0.0.1:5", "http://h:99999")):
        with pytest.raises(ConfigError):
            NodeRecord("n1", data, control)
        raw = msgspec.msgpack.encode(["node/2", "n1", data, control, b"", 0.0])
        with pytest.raises(ClusterError):
            NodeRecord.decode(raw)


@pytest.mark.asyncio
async def test_nodes_see_each_other_and_one_leads(etcd):
    addr = address(etcd)
    a, b = member(addr, "a"), member(addr, "b")
    await a.start()
    await b.start()
    try:
        await a.wait_for(lambda m: set(m.members) == {"a", "b"}, 10)
        assert set(b.members) == {"a", "b"}
        assert b.members["a"].agent_metadata == b"meta-a"
        assert a.is_leader and not b.is_leader and b.leader_id == "a"
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.asyncio
async def test_a_graceful_leave_is_seen_at_once_and_the_standby_leads(etcd):
    addr = address(etcd)
    a, b = member(addr, "a"), member(addr, "b")
    await a.start()
    await b.start()
    events = b.subscribe()
    try:
        await a.stop(graceful=True)
        await b.wait_for(lambda m: m.is_leader and "a" not in m.members, 5)
        seen = []
        while not events.empty():
            seen.append(events.get_nowait())
        assert (Change.LEFT, "a") in [(e.change, e.node_id) for e in seen]
    finally:
        await b.stop()


@pytest.mark.asyncio
async def test_a_crashed_leader_is_replaced_after_its_lease_expires(etcd):
    addr = address(etcd)
    a, b, c = member(addr, "a"), member(addr, "b"), member(addr, "c")
    for m in (a, b, c):
        await m.start()
    try:
        await c.wait_for(lambda m: len(m.members) == 3, 10)
        await a.stop(graceful=False)           # silent: no revoke, like a SIGKILL
        assert "a" in b.members                # still there until the TTL runs out
        await b.wait_for(lambda m: "a" not in m.members and m.leader_id in ("b", "c"), 4 * TTL + 5)
        await c.wait_for(lambda m: m.leader_id == b.leader_id, 5)
        assert [b.is_leader, c.is_leader].count(True) == 1
    finally:
        await b.stop()
        await c.stop()


@pytest.mark.asyncio
async def test_a_node_that_comes_back_registers_again(etcd):
    addr = address(etcd)
    a, b = member(addr, "a"), member(addr, "b")
    await a.start()
    await b.start()
    try:
        await b.stop()
        await a.wait_for(lambda m: "b" not in m.members, 5)
        b = member(addr, "b")
        await b.start()
        await a.wait_for(lambda m: "b" in m.members, 5)
        assert b.leader_id == "a"
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.asyncio
async def test_no_etcd_is_a_clear_error():
    m = member(parse_etcd_url("etcd://127.0.0.1:1/x"), "a")
    with pytest.raises(ClusterError, match="no etcd endpoint answered"):
        await m.start()


@pytest.mark.asyncio
async def test_an_observer_follows_without_registering(etcd):
    addr = address(etcd)
    a = member(addr, "a")
    await a.start()
    watcher = ClusterMember(addr, None, ttl_s=TTL)
    await watcher.start()
    try:
        assert set(watcher.members) == {"a"} and watcher.leader_id == "a"
        assert not watcher.is_leader
        b = member(addr, "b")
        await b.start()
        await watcher.wait_for(lambda m: "b" in m.members, 5)
        await b.stop()
        await watcher.wait_for(lambda m: "b" not in m.members, 5)
        # a follows its own watch stream, which may deliver b's delete a moment after the watcher's
        await a.wait_for(lambda m: set(m.members) == {"a"}, 5)
    finally:
        await watcher.stop()
        await a.stop()


@pytest.mark.asyncio
async def test_a_second_node_of_one_id_is_refused_and_the_first_stays(etcd):
    """A second daemon started with a live daemon's node id took its key over without a
    word: the first dropped out of the pool for good (its lease still holding the leader
    key). It is refused now, once a predecessor's lease would have run out."""
    addr = address(etcd)
    a = member(addr, "a")
    await a.start()
    watcher = ClusterMember(addr, None, ttl_s=TTL)
    await watcher.start()
    twin = ClusterMember(addr, NodeRecord("a", "127.0.0.1:1", "http://127.0.0.1:2"), ttl_s=TTL)
    try:
        with pytest.raises(ClusterError, match="own --node-id"):
            await twin.start()
        await twin.stop()
        assert watcher.members["a"] == a.record and watcher.leader_id == "a"
    finally:
        await watcher.stop()
        await a.stop()


@pytest.mark.asyncio
async def test_a_crashed_nodes_successor_of_its_id_waits_its_key_out(etcd):
    addr = address(etcd)
    a = member(addr, "a")
    await a.start()
    await a.stop(graceful=False)  # (its key stays until the lease runs out)
    again = ClusterMember(addr, NodeRecord("a", "127.0.0.1:3", "http://127.0.0.1:4"), ttl_s=TTL)
    await again.start()
    try:
        assert again.members["a"] == again.record
    finally:
        await again.stop()


@pytest.mark.asyncio
async def test_a_record_that_does_not_decode_is_skipped_and_the_watch_goes_on(etcd):
    """A node key holding no record this build reads ended the watch silently (departures
    went unseen for good), and joining nodes and new clients failed on it."""
    addr = address(etcd)
    a = member(addr, "a")
    await a.start()
    junk = f"{addr.prefix}/nodes/junk".encode()
    try:
        await a._client.put(junk, b"not-a-record")
        await a._client.put(f"{addr.prefix}/nodes/liar".encode(), member(addr, "x").record.encode())
        b = member(addr, "b")
        await b.start()  # (its load reads the junk)
        watcher = ClusterMember(addr, None, ttl_s=TTL)
        await watcher.start()
        try:
            assert set(watcher.members) == {"a", "b"}
            await a.wait_for(lambda m: "b" in m.members, 5)
            await b.stop()
            await a.wait_for(lambda m: "b" not in m.members, 5)  # the watch still runs
            await watcher.wait_for(lambda m: "b" not in m.members, 5)
        finally:
            await watcher.stop()
    finally:
        await a._client.delete(junk)
        await a.stop()


@pytest.mark.asyncio
async def test_a_node_whose_key_was_deleted_registers_again(etcd):
    addr = address(etcd)
    a = member(addr, "a")
    await a.start()
    watcher = ClusterMember(addr, None, ttl_s=TTL)
    await watcher.start()
    try:
        await watcher._client.delete(a._node_key)
        await watcher.wait_for(lambda m: "a" not in m.members, 5)
        await watcher.wait_for(lambda m: "a" in m.members, 3 * TTL)
    finally:
        await watcher.stop()
        await a.stop()


@pytest.mark.asyncio
async def test_a_node_whose_id_was_taken_while_away_stops_leading(etcd):
    """A node whose lease ran out (a partition past the TTL) while another daemon took its
    id went on believing it led, beside the daemon that did."""
    addr = address(etcd)
    a = ClusterMember(addr, NodeRecord("x", "127.0.0.1:5", "http://127.0.0.1:6"), ttl_s=TTL)
    await a.start()
    assert a.is_leader
    await a._lease.revoke()  # (its lease gone behind its back, as in a long partition)
    b = ClusterMember(addr, NodeRecord("x", "127.0.0.1:7", "http://127.0.0.1:8"), ttl_s=TTL)
    await b.start()
    try:
        await b.wait_for(lambda m: m.is_leader, 3 * TTL)
        await a.wait_for(lambda m: m.out and m.members.get("x") == b.record, 3 * TTL)
        assert not a.is_leader
    finally:
        await b.stop()
        await a.stop()


class CutOffProxy:
    """A TCP relay to etcd that can be cut: from then on no byte passes either way while
    every connection stays open (a partition: packets dropped, nothing reset), until healed."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.open = asyncio.Event()
        self.open.set()
        self.server = None
        self.port = 0

    async def start(self) -> "CutOffProxy":
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _relay(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    await self.open.wait()
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        self.open.set()
        self.server.close()


@pytest.mark.asyncio
async def test_a_leader_cut_off_from_etcd_stops_leading_before_another_may_lead(etcd):
    """A leader whose refreshes stop getting through (a partition from etcd, a stalled loop)
    led on for as long as that lasted, beside the node etcd had made leader once its lease ran
    out. Now it stops before etcd can let the lease go: never two leaders at one time."""
    addr = address(etcd)
    proxy = await CutOffProxy(addr.endpoints[0]).start()
    via_proxy = addr._replace(endpoints=(("127.0.0.1", proxy.port),))
    a, b = member(via_proxy, "a"), member(addr, "b")
    await a.start()
    await b.start()
    try:
        await b.wait_for(lambda m: set(m.members) == {"a", "b"} and m.leader_id == "a", 10)
        assert a.is_leader
        proxy.open.clear()
        both, a_stopped, b_started = 0, None, None
        deadline = time.monotonic() + 4 * TTL + 5
        while b_started is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            a_leads, b_leads = a.is_leader, b.is_leader  # (one instant: no await between)
            both += a_leads and b_leads
            if not a_leads and a_stopped is None:
                a_stopped = time.monotonic()
            if b_leads:
                b_started = time.monotonic()
        assert b_started is not None, "etcd never let the cut-off leader's lease go"
        assert both == 0 and a_stopped is not None and a_stopped <= b_started
        assert not a.is_leader and a.lease_lapsed
        assert a.leader_id == "a"  # what it last saw; it does not act on it
        proxy.open.set()  # healed: back as a member, led by b
        await b.wait_for(lambda m: "a" in m.members, 4 * TTL + 5)
        await a.wait_for(lambda m: m.leader_id == "b" and "a" in m.members and not m.out,
                         4 * TTL + 5)
        assert not a.is_leader and not a.lease_lapsed and b.is_leader
    finally:
        await b.stop()
        await a.stop()
        await proxy.close()


def lose_refresh_answers(m: ClusterMember) -> list:
    """Refreshes of m's lease reach etcd, and their answers are lost (the keepalive stream
    ends with none): etcd keeps the lease alive while m hears nothing. Returns a list: put
    anything in it and the answers come through again."""
    real, healed = m._client.refresh_lease, []

    async def unanswered(lease_id):
        reply = await real(lease_id)
        return reply if healed else None
    m._client.refresh_lease = unanswered
    return healed


@pytest.mark.asyncio
async def test_a_leader_whose_refreshes_go_unanswered_gives_the_lead_up(etcd):
    """A leader whose refreshes reach etcd but go unanswered stops leading by its own clock
    while etcd keeps its lease, and with it the leader key: it answered 503 for as long as
    that lasted, and no other node could lead. Now it gives the key up, another leads
    (never beside it), and it does not take the lead back; answered again, it follows."""
    addr = address(etcd)
    a, b = member(addr, "a"), member(addr, "b")
    await a.start()
    await b.start()
    try:
        await b.wait_for(lambda m: set(m.members) == {"a", "b"} and m.leader_id == "a", 10)
        healed = lose_refresh_answers(a)
        both, b_started = 0, None
        deadline = time.monotonic() + 4 * TTL + 5
        while b_started is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            a_leads, b_leads = a.is_leader, b.is_leader  # (one instant: no await between)
            both += a_leads and b_leads
            if b_leads:
                b_started = time.monotonic()
        assert b_started is not None, "the leader whose refreshes went unanswered kept the lead"
        assert both == 0 and not a.is_leader and a.lease_lapsed
        await asyncio.sleep(2 * TTL)
        assert "a" in b.members  # its lease lived on in etcd: still a member,
        assert b.is_leader and not a.is_leader and a.leader_id == "b"  # and no leader again
        healed.append(True)
        await a.wait_for(lambda m: not m.lease_lapsed, 2 * TTL)
        assert not a.is_leader and b.is_leader and a.leader_id == "b"
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.asyncio
async def test_a_lone_node_that_gave_the_lead_up_takes_it_again_once_answered(etcd):
    """With no other node to take it, the lead a node gave up while its refreshes went
    unanswered is its own again once they are answered."""
    a = member(address(etcd), "a")
    await a.start()
    try:
        assert a.is_leader
        healed = lose_refresh_answers(a)
        await a.wait_for(lambda m: m.leader_id is None, 4 * TTL)  # given up (seen by its
        assert not a.is_leader  # watch, which still works)
        await asyncio.sleep(TTL)
        assert a.leader_id is None  # no campaign while lapsed
        healed.append(True)
        await a.wait_for(lambda m: m.is_leader, 2 * TTL)
    finally:
        await a.stop()


@pytest.mark.asyncio
async def test_a_resign_that_hangs_does_not_hold_the_refreshes_up(etcd):
    """The leader key's delete runs beside the refreshes: awaited among them, its timeout
    spaced them out past the TTL (with the client's own timeout on a refresh whose answer
    is lost), and etcd let the lease of a node whose every refresh got through go."""
    a = member(address(etcd), "a")
    await a.start()
    try:
        real_txn, resigns, refreshes = a._client.transaction, [], []

        async def transaction(compare, success=None, failure=None):
            if success and isinstance(success[0], aetcd.transactions.Delete):
                resigns.append(time.monotonic())
                await asyncio.Event().wait()  # an answer that never comes
            return await real_txn(compare, success, failure)
        a._client.transaction = transaction
        real_refresh = a._client.refresh_lease

        async def unanswered(lease_id):
            refreshes.append(time.monotonic())
            await real_refresh(lease_id)
        a._client.refresh_lease = unanswered
        deadline = time.monotonic() + 4 * TTL
        while not resigns and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert resigns, "the lapsed leader never tried to give the lead up"
        await asyncio.sleep(TTL)
        assert len([t for t in refreshes if t > resigns[0]]) >= 2  # every TTL/3 as ever
    finally:
        await a.stop()


@pytest.mark.asyncio
async def test_a_node_out_of_the_pool_never_deletes_the_leader_key_of_its_ids_new_daemon(etcd):
    """A daemon out of the pool (another took its id, and leads) sees that id lead, and its
    own lease is long unconfirmed: its keepalive's etcd errors must not delete the key the
    other daemon leads under (a new term for the whole pool)."""
    addr = address(etcd)
    a = ClusterMember(addr, NodeRecord("x", "127.0.0.1:5", "http://127.0.0.1:6"), ttl_s=TTL)
    await a.start()
    await a._lease.revoke()  # a's key goes; b takes the id
    b = ClusterMember(addr, NodeRecord("x", "127.0.0.1:7", "http://127.0.0.1:8"), ttl_s=TTL)
    await b.start()
    try:
        await b.wait_for(lambda m: m.is_leader, 3 * TTL)
        await a.wait_for(lambda m: m.out and m.members.get("x") == b.record, 3 * TTL)
        term = b.leader_term
        await asyncio.sleep(TTL)
        await a._load()  # as a's watch does after a break
        assert a.leader_id == "x" and a.lease_lapsed and a.out
        real_get = a._client.get

        async def failing_get(key, *args, **kw):  # every try to come back meets an error
            raise aetcd.ConnectionTimeoutError("injected")
        a._client.get = failing_get
        before = (await b._client.get(b._leader_key)).create_revision
        await asyncio.sleep(2 * TTL)
        a._client.get = real_get
        assert (await b._client.get(b._leader_key)).create_revision == before
        assert b.leader_term == term and b.is_leader
    finally:
        await b.stop()
        await a.stop()


def _etcd_members(tmp_path, n: int = 3):
    """n etcd processes forming one cluster on loopback: (processes, client ports)."""
    import socket
    import subprocess
    import urllib.request

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    ports = [(free(), free()) for _ in range(n)]
    initial = ",".join(f"e{i}=http://127.0.0.1:{pp}" for i, (_, pp) in enumerate(ports))
    procs = []
    for i, (cp, pp) in enumerate(ports):
        d = tmp_path / f"e{i}"
        d.mkdir()
        procs.append(subprocess.Popen(
            ["etcd", "--name", f"e{i}", "--data-dir", str(d / "data"),
             "--listen-client-urls", f"http://127.0.0.1:{cp}",
             "--advertise-client-urls", f"http://127.0.0.1:{cp}",
             "--listen-peer-urls", f"http://127.0.0.1:{pp}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}",
             "--initial-cluster", initial, "--initial-cluster-state", "new",
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=open(d / "log", "wb"), stderr=subprocess.STDOUT))

    def healthy(cp: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{cp}/health", timeout=2) as r:
                return b'"true"' in r.read()
        except OSError:
            return False
    deadline = time.monotonic() + 60
    while not all(healthy(cp) for cp, _ in ports):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError("the etcd cluster did not become healthy")
        time.sleep(0.1)
    return procs, [cp for cp, _ in ports]


@pytest.mark.asyncio
async def test_the_pool_carries_on_when_the_first_etcd_endpoint_goes(tmp_path, etcd):
    """Three etcd members, the first stopped, the other two keep quorum: a node held on to
    the endpoint that answered first at its start, its lease ran out, and the pool stood
    empty (no members, no leader) until that member came back. Now each moves on to the
    next endpoint that answers, its lease with it."""
    procs, ports = _etcd_members(tmp_path)
    addr = parse_etcd_url("etcd://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/failover")
    a, b = member(addr, "a"), member(addr, "b")
    try:
        await a.start()
        await b.start()
        await b.wait_for(lambda m: set(m.members) == {"a", "b"} and m.leader_id == "a", 10)
        procs[0].terminate()
        procs[0].wait()
        await asyncio.sleep(3 * TTL + 1)  # past every lease, were they not refreshed
        assert set(a.members) == set(b.members) == {"a", "b"}
        assert a.is_leader and not b.is_leader and b.leader_id == "a"
        watcher = ClusterMember(addr, None, ttl_s=TTL)  # a newcomer finds them too
        await watcher.start()
        try:
            assert set(watcher.members) == {"a", "b"} and watcher.leader_id == "a"
        finally:
            await watcher.stop()
    finally:
        await b.stop()
        await a.stop()
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()


@pytest.mark.asyncio
async def test_a_pool_whose_prefix_lies_under_another_stays_out_of_it(etcd):
    """Pools `/P` and `/P/nodes/gpu`: the outer one took the inner one's node keys by their
    last segment, so its `n0` joined the outer pool, and when it left, the outer pool's own
    live `n0` vanished from every view there."""
    outer = address(etcd)
    inner = parse_etcd_url(f"etcd://{etcd.endpoint}{outer.prefix}/nodes/gpu")
    a = member(outer, "n0")
    b = ClusterMember(inner, NodeRecord("n0", "127.0.0.1:1", "http://127.0.0.1:2", b"inner"),
                      ttl_s=TTL)
    await a.start()
    watcher = ClusterMember(outer, None, ttl_s=TTL)
    await watcher.start()
    try:
        await b.start()
        await asyncio.sleep(0.5)
        assert watcher.members == {"n0": a.record} and a.members == {"n0": a.record}
        await b.stop()
        await asyncio.sleep(0.5)
        assert watcher.members == {"n0": a.record} and a.members == {"n0": a.record}
        fresh = ClusterMember(outer, None, ttl_s=TTL)
        await fresh.start()
        try:
            assert fresh.members == {"n0": a.record} and fresh.leader_id == "n0"
        finally:
            await fresh.stop()
    finally:
        await watcher.stop()
        await a.stop()


@pytest.mark.asyncio
async def test_a_leader_key_under_no_lease_is_cleared_and_a_node_leads_again(etcd):
    """A leader key written by hand (no lease: it never expires) kept the pool without a
    leader for good, and through restarts."""
    addr = address(etcd)
    a, b = member(addr, "a"), member(addr, "b")
    await a.start()
    await b.start()
    try:
        await b.wait_for(lambda m: m.leader_id == "a", 10)
        await a._client.put(a._leader_key, b"ghost")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            held = await a._client.get(a._leader_key)
            if held is not None and held.lease and held.value in (b"a", b"b") \
                    and a.leader_term == b.leader_term == (held.value.decode(), held.lease):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"no node leads again: the key holds {held}")
        assert [a.is_leader, b.is_leader].count(True) == 1
    finally:
        await b.stop()
        await a.stop()
    other = ClusterMember(addr, None, ttl_s=TTL)
    await other.start()
    try:
        await other._client.put(other._leader_key, b"ghost")  # left behind, then a start
    finally:
        await other.stop()
    c = member(addr, "c")
    await c.start()
    try:
        await c.wait_for(lambda m: m.is_leader, 10)
    finally:
        await c.stop()


def test_node_ids_and_prefixes_that_cannot_be_named_are_refused():
    with pytest.raises(ConfigError, match="UTF-8"):
        NodeRecord("n\udcff", "127.0.0.1:1", "http://127.0.0.1:2")
    for url in ("etcd://127.0.0.1:2379/pool#a", "etcd://127.0.0.1:2379/pool?x=1"):
        with pytest.raises(ConfigError, match="'\\?' or '#'"):
            parse_etcd_url(url)
