"""ClusterIndex: event application, gaps, snapshots and prefix queries."""
import pytest

from kvstore.events import EventKind, KVEvent, TierKind
from kvstore.index import ClusterIndex, UnknownNodeError


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def stored(node, seq, ids, tier=TierKind.DRAM):
    return KVEvent(EventKind.STORED, node, seq, tier, tuple(h(i) for i in ids))


def removed(node, seq, ids, tier=TierKind.DRAM):
    return KVEvent(EventKind.REMOVED, node, seq, tier, tuple(h(i) for i in ids))


def test_prefix_lengths_per_node():
    index = ClusterIndex()
    index.apply(stored("a", 0, [0, 1, 2, 3]))
    index.apply(stored("b", 0, [0, 1]))
    index.apply(stored("c", 0, [1, 2, 3]))  # no first block: no prefix at all
    match = index.query([h(i) for i in range(5)])
    assert (match.length("a"), match.length("b"), match.length("c")) == (4, 2, 0)
    assert match.best() == ("a", 4)
    assert match.best(exclude=["a"]) == ("b", 2)
    assert set(match.nodes()) == {"a", "b"}
    assert match.length("nobody") == 0


def test_hole_in_the_middle_ends_the_prefix():
    index = ClusterIndex()
    index.apply(stored("a", 0, [0, 1, 3, 4]))
    assert index.query([h(i) for i in range(5)]).length("a") == 2


def test_full_query_held_entirely():
    index = ClusterIndex()
    index.apply(stored("a", 0, range(10)))
    assert index.query([h(i) for i in range(10)]).length("a") == 10
    assert index.query([]).best() == (None, 0)


def test_tiers_report_fastest_copy():
    index = ClusterIndex()
    index.apply(stored("a", 0, [0, 1, 2], TierKind.SSD))
    index.apply(stored("a", 1, [1], TierKind.GPU))
    match = index.query([h(0), h(1), h(2)])
    assert match.tiers("a") == (TierKind.SSD, TierKind.GPU, TierKind.SSD)


def test_remove_from_one_tier_keeps_other_copy():
    index = ClusterIndex()
    index.apply(stored("a", 0, [0, 1], TierKind.GPU))
    index.apply(stored("a", 1, [0, 1], TierKind.DRAM))
    index.apply(removed("a", 2, [1], TierKind.GPU))
    match = index.query([h(0), h(1)])
    assert match.length("a") == 2
    assert match.tiers("a") == (TierKind.GPU, TierKind.DRAM)
    index.apply(removed("a", 3, [1], TierKind.DRAM))
    assert index.query([h(0), h(1)]).length("a") == 1


def test_reordered_events_are_buffered_then_applied():
    index = ClusterIndex(reorder_window=4)
    out = index.apply(stored("a", 1, [1]))
    assert out.buffered and not out.stale
    assert index.query([h(0), h(1)]).length("a") == 0
    out = index.apply(stored("a", 0, [0]))
    assert out.applied == 2
    assert index.query([h(0), h(1)]).length("a") == 2
    assert index.apply(stored("a", 0, [7])).applied == 0  # duplicate ignored


def test_gap_beyond_window_marks_stale_and_snapshot_recovers():
    index = ClusterIndex(reorder_window=2)
    index.apply(stored("a", 0, [0]))
    index.apply(stored("b", 0, [0]))
    for seq in (2, 3, 4):  # seq 1 lost
        index.apply(stored("a", seq, [seq]))
    assert index.is_stale("a") and index.stale_nodes() == ("a",)
    assert index.query([h(0)]).nodes() == ("b",)  # a stale node is never routed to
    assert index.apply_snapshot("a", 3, {TierKind.DRAM: [h(0), h(1), h(2), h(3)]})
    assert not index.is_stale("a")
    assert index.next_seq("a") == 5  # buffered seq 4 replayed after the snapshot
    assert index.blocks_of("a", TierKind.DRAM) == {h(i) for i in range(5)}


def test_outdated_snapshot_is_refused():
    index = ClusterIndex()
    index.apply_n([stored("a", 0, [0]), stored("a", 1, [1]), stored("a", 2, [2])])
    assert not index.apply_snapshot("a", 0, {TierKind.DRAM: [h(9)]})
    assert index.blocks_of("a", TierKind.DRAM) == {h(0), h(1), h(2)}


def test_late_joiner_is_stale_until_snapshot():
    index = ClusterIndex(reorder_window=0)
    out = index.apply(stored("a", 41, [0]))
    assert out.stale
    index.apply_snapshot("a", 41, {TierKind.GPU: [h(0)]})
    assert index.query([h(0)]).length("a") == 1


def test_remove_node_frees_its_blocks_and_bit():
    index = ClusterIndex()
    index.apply(stored("a", 0, [0, 1]))
    index.remove_node("a")
    assert index.query([h(0)]).nodes() == ()
    index.apply(stored("b", 0, [0]))
    assert index.query([h(0), h(1)]).nodes() == ("b",)
    with pytest.raises(UnknownNodeError):
        index.is_stale("a")


def test_many_nodes_beyond_64_bits():
    index = ClusterIndex()
    for n in range(100):
        index.apply(stored(f"n{n}", 0, range(n % 7)))
    match = index.query([h(i) for i in range(7)])
    assert all(match.length(f"n{n}") == n % 7 for n in range(100))


def test_holders_lists_live_nodes_per_hash():
    from kvstore.events import EventKind, KVEvent, TierKind
    from kvstore.index import ClusterIndex
    idx = ClusterIndex()
    idx.apply(KVEvent(EventKind.STORED, "b", 0, TierKind.DRAM, (b"x", b"y")))
    idx.apply(KVEvent(EventKind.STORED, "a", 0, TierKind.SSD, (b"y",)))
    assert idx.holders([b"x", b"y", b"z"]) == [("b",), ("a", "b"), ()]
    idx.mark_stale("b")
    assert idx.holders([b"x", b"y"]) == [(), ("a",)]


def test_prefixes_from_holders_agree_with_the_leaders_query():
    """A tenant's pool client locates a big batch in pieces and makes the prefixes from
    the pieces' holders (kvstore.client.cluster.leading_holders): the same as the leader's."""
    import random

    from kvstore.client.cluster import leading_holders
    from kvstore.cluster.messages import Locate
    from kvstore.daemon.cluster import MetadataService
    rng = random.Random(5)
    for trial in range(200):
        svc = MetadataService()
        index = svc.index(7)
        for node in "abcd":
            n = rng.randrange(0, 12)
            ids = [i for i in range(n) if rng.random() > 0.1] + rng.sample(range(20), 3)
            index.apply(stored(node, 0, ids))
        if trial % 3 == 0:
            index.remove_node("b")
        hashes = tuple(h(i) for i in range(rng.randrange(1, 15)))
        want = svc.locate(Locate(7, hashes))
        assert leading_holders(want.holders) == want.prefix
    assert leading_holders([]) == () and leading_holders([()]) == ()


def test_a_namespaces_roots_leave_with_the_nodes_that_named_them():
    """The leader answers a tenant's locate only where every live node holding blocks of the
    id named it by the namespace's whole root. A root named by a node that left stayed for
    the leader's life (the id unverified: every locate fanned out to all members); a node
    that is no member, or one of an older version that names no root, must not make an
    index look like the namespace's either."""
    from kvstore.cluster.messages import NamespaceRoot
    from kvstore.daemon.cluster import MetadataService
    from kvstore.keys import Namespace
    ns = Namespace("m", num_layers=1, num_kv_heads=1, head_dim=8)
    root, twin = bytes(ns.root_hash), bytes(ns.root_hash)[:8] + bytes(8)  # (one 64-bit id)
    members = dict.fromkeys("abc")
    svc = MetadataService(members)
    assert svc.verified(ns) is None  # no index of the id
    idx = svc.index(ns.ns_id)
    for node in "ab":
        svc.note_root(NamespaceRoot(node, ns.ns_id, root))
        idx.apply(stored(node, 0, [1]))
    assert svc.verified(ns) is True
    idx.apply(stored("c", 0, [2]))
    assert svc.verified(ns) is False  # c holds blocks of the id and named no root
    svc.note_root(NamespaceRoot("c", ns.ns_id, twin))
    assert svc.verified(ns) is False  # c named another namespace of the id
    svc.note_root(NamespaceRoot("n9", ns.ns_id, twin))  # (no member: speaks for nothing)
    svc.forget("a")
    assert svc.verified(ns) is False
    del members["c"]  # left; the leader not yet told
    assert svc.verified(ns) is True
    svc.forget("c")
    assert set(svc.roots[ns.ns_id]) == {root, twin}  # (n9's stays, unheard)
    assert svc.roots[ns.ns_id][root] == {"b"}
    del members["b"]
    svc.forget("b")
    assert svc.verified(ns) is None  # no live node holds any of it
    assert set(svc.roots[ns.ns_id]) == {twin}
    for node in "pqrstu":  # at most 4 roots an id; a root already named takes more nodes
        svc.note_root(NamespaceRoot(node, ns.ns_id, twin[:8] + node.encode() * 8))
    assert len(svc.roots[ns.ns_id]) == 4
    svc.note_root(NamespaceRoot("v", ns.ns_id, twin[:8] + b"p" * 8))
    assert svc.roots[ns.ns_id][twin[:8] + b"p" * 8] == {"p", "v"}


def test_the_leader_answers_with_live_members_only_and_a_node_names_one_root_an_id():
    """A node that is no member (not joined yet in the leader's view, or gone on reporting
    after it left) is no holder in a locate: it spoke for nothing in `verified`, and a
    client cannot read from it (it took a slot of the prefix a client asks). A node names
    one root an id: the last it named."""
    from kvstore.cluster.messages import EventBatch, Locate, NamespaceRoot
    from kvstore.daemon.cluster import MetadataService
    from kvstore.keys import Namespace
    ns = Namespace("m", num_layers=1, num_kv_heads=1, head_dim=8)
    root, twin = bytes(ns.root_hash), bytes(ns.root_hash)[:8] + bytes(8)
    members = dict.fromkeys("a")
    svc = MetadataService(members)
    idx = svc.index(ns.ns_id)
    idx.apply(stored("a", 0, [1]))
    idx.apply(stored("y", 0, [1, 2]))
    svc.note_root(NamespaceRoot("a", ns.ns_id, root))
    svc.note_root(NamespaceRoot("y", ns.ns_id, twin))
    got = svc.locate(Locate(ns.ns_id, (h(1), h(2))))
    assert got.holders == (("a",), ()) and got.prefix == (("a", 1),)
    members["y"] = None  # y joins: the id now has two namespaces' nodes
    assert svc.verified(ns) is False
    assert svc.locate(Locate(ns.ns_id, (h(1), h(2)))).holders == (("a", "y"), ("y",))
    svc.note_root(NamespaceRoot("y", ns.ns_id, root))  # y restarted serving ns itself
    assert svc.roots[ns.ns_id] == {root: {"a", "y"}} and svc.verified(ns) is True
    # an empty report: "ok" from a node the index knows, "resync" from one it does not (a
    # new term's leader: an idle node's blocks come back)
    assert svc.apply_events(EventBatch("a", ns.ns_id, ())) is False
    assert MetadataService(members).apply_events(EventBatch("a", ns.ns_id, ())) is True


def test_an_empty_snapshot_takes_the_node_out_of_the_ids_index_and_roots():
    """A node whose namespace was cleared reports it empty: its blocks leave the index, and
    it speaks for nothing of the id. A leader that never heard of the namespace gets that
    report too (the leadership moved meanwhile): it must not leave the id unverified (every
    tenant locate a 409) once another node reports it. An empty report (no events) from a
    node known to hold none is no resync; events from it are."""
    from kvstore.cluster.messages import EventBatch, Locate, NamespaceRoot, Snapshot
    from kvstore.daemon.cluster import MetadataService
    from kvstore.keys import Namespace
    ns = Namespace("m", num_layers=1, num_kv_heads=1, head_dim=8)
    root = bytes(ns.root_hash)
    members = dict.fromkeys("ab")
    svc = MetadataService(members)
    for node, blocks in (("a", [1, 2]), ("b", [2])):
        svc.note_root(NamespaceRoot(node, ns.ns_id, root))
        svc.apply_snapshot(Snapshot(node, ns.ns_id, 0, {TierKind.DRAM: [h(i) for i in blocks]}))
    assert svc.verified(ns) is True
    svc.apply_snapshot(Snapshot("a", ns.ns_id, -1, {}))  # cleared on a
    assert svc.locate(Locate(ns.ns_id, (h(1), h(2)))).holders == ((), ("b",))
    assert svc.verified(ns) is True and svc.roots[ns.ns_id] == {root: {"b"}}
    assert svc.apply_events(EventBatch("a", ns.ns_id, ())) is False  # holds none: no resync
    assert svc.apply_events(EventBatch("a", ns.ns_id, (stored("a", 0, [3]),))) is True
    svc.apply_snapshot(Snapshot("a", ns.ns_id, 0, {TierKind.DRAM: [h(3)]}))  # back
    assert svc.locate(Locate(ns.ns_id, (h(3),))).holders == (("a",),)
    assert svc.verified(ns) is False  # (a named no root since: it does with its snapshot)
    fresh = MetadataService(members)  # a new term's leader: a's report of the clear first
    fresh.apply_snapshot(Snapshot("a", ns.ns_id, -1, {}))
    fresh.note_root(NamespaceRoot("b", ns.ns_id, root))
    fresh.apply_snapshot(Snapshot("b", ns.ns_id, 0, {TierKind.DRAM: [h(2)]}))
    assert fresh.verified(ns) is True
    fresh.forget("a")
    assert "a" not in fresh.empty.get(ns.ns_id, ())
    assert fresh.apply_events(EventBatch("a", ns.ns_id, ())) is True  # unknown again


def test_the_leader_keeps_nothing_of_a_namespace_id_no_node_holds():
    """A leader kept an index and an `empty` entry for every namespace id it ever heard
    of, until its term ended (a pool whose tenants come and go: one per namespace cleared,
    all listed in /cluster). Once no node holds or reports any of an id, nothing of it is
    left; an id still held by one node keeps its index."""
    from kvstore.cluster.messages import EventBatch, NamespaceRoot, Snapshot
    from kvstore.daemon.cluster import MetadataService
    svc = MetadataService(dict.fromkeys("ab"))
    ids = range(100, 140)
    for ns_id in ids:
        root = ns_id.to_bytes(8, "little") + bytes(8)
        for node in "ab":
            svc.note_root(NamespaceRoot(node, ns_id, root))
            svc.apply_snapshot(Snapshot(node, ns_id, 0, {TierKind.DRAM: [h(ns_id)]}))
    for ns_id in ids:
        svc.apply_snapshot(Snapshot("a", ns_id, -1, {}))  # cleared on a
    assert set(svc.indexes) == set(ids) and set(svc.empty) == set(ids)
    for ns_id in ids[:30]:
        svc.apply_snapshot(Snapshot("b", ns_id, -1, {}))  # ...and on b
    assert set(svc.indexes) == set(ids[30:])
    assert all(svc.indexes[i].node_ids() == ("b",) for i in ids[30:])
    assert set(svc.empty) == set(ids) and svc.empty[100] == {"a", "b"}
    svc.forget("a")
    assert set(svc.empty) == set(ids[:30]) and svc.empty[100] == {"b"}
    svc.forget("b")
    assert svc.indexes == {} and svc.empty == {} and svc.roots == {}
    # an empty snapshot or report of an id never heard of makes no entry in the index
    svc.apply_snapshot(Snapshot("a", 999, -1, {}))
    assert svc.apply_events(EventBatch("b", 998, ())) is True  # (unknown: a resync)
    assert svc.indexes == {} and svc.empty == {999: {"a"}}
    assert svc.apply_events(EventBatch("a", 999, ())) is False  # known to hold none


def test_a_leader_unsure_of_its_lease_answers_503_and_another_nodes_role_409():
    import types

    from aiohttp import web

    from kvstore.cluster.membership import ClusterMember, lease_clock
    from kvstore.cluster.records import NodeRecord, parse_etcd_url
    from kvstore.daemon.cluster import MetadataService, _check_leading
    member = ClusterMember(parse_etcd_url("etcd://127.0.0.1:1/t"),
                           NodeRecord("a", "127.0.0.1:5", "http://127.0.0.1:6"))
    agent = types.SimpleNamespace(member=member, cfg=types.SimpleNamespace(node_id="a"),
                                  service=MetadataService())
    member._lease = types.SimpleNamespace(id=7)  # (the lease etcd granted: its id alone)
    member._set_leader("a", 7)
    member._lease_until = lease_clock() + 5

    def answer():
        try:
            _check_leading(agent)
        except (web.HTTPServiceUnavailable, web.HTTPConflict) as e:
            assert e.status != 503 or e.headers["Retry-After"] == "1"
            return e.status
        return 200
    assert answer() == 503  # its term's index not set up yet (the LEADER event not handled)
    agent.service.term = member.leader_term
    assert answer() == 200
    member._lease_until = lease_clock()  # no refresh confirmed within the TTL
    assert answer() == 503
    member._lease_until = lease_clock() + 5
    member._set_leader("a", 8)  # the key under another of its leases
    assert answer() == 503
    member._set_leader("a", 7)
    assert answer() == 200
    member._set_leader("b", 9)
    assert answer() == 409
