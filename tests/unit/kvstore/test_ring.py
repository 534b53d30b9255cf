import collections

from kvstore.cluster.ring import HashRing
from kvstore.keys import Namespace, hash_blocks

NS = Namespace("m", 1, 1, 8)
KEYS = hash_blocks(NS, list(range(16 * 4000)))


def test_owners_are_distinct_and_stable():
    ring = HashRing(["a", "b", "c"])
    for k in KEYS[:100]:
        owners = ring.owners(k, replicas=2)
        assert len(owners) == 2 and len(set(owners)) == 2
        assert owners == HashRing(["c", "a", "b"]).owners(k, replicas=2)
    assert ring.owners(KEYS[0], replicas=5) == ring.owners(KEYS[0], replicas=3)
    assert HashRing().owners(KEYS[0]) == []


def test_load_is_spread():
    ring = HashRing([f"n{i}" for i in range(4)])
    counts = collections.Counter(ring.owners(k)[0] for k in KEYS)
    assert min(counts.values()) > len(KEYS) / 4 * 0.6


def test_a_leaving_node_moves_only_its_own_blocks():
    ring = HashRing(["a", "b", "c", "d"])
    before = {k: ring.owners(k)[0] for k in KEYS}
    ring.remove("d")
    after = {k: ring.owners(k)[0] for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == "d" for k in moved)
    ring.add("d")
    assert {k: ring.owners(k)[0] for k in KEYS} == before


def test_cluster_messages_roundtrip_and_refuse_garbage():
    import pytest
    from kvstore.cluster.messages import EventBatch, Locate, Located, Snapshot
    from kvstore.cluster.records import ClusterError
    from kvstore.events import EventKind, KVEvent, TierKind
    ev = KVEvent(EventKind.STORED, "n1", 3, TierKind.SSD, tuple(KEYS[:3]))
    assert EventBatch.decode(EventBatch("n1", 7, (ev,)).encode()) == EventBatch("n1", 7, (ev,))
    snap = Snapshot("n1", 7, 3, {TierKind.DRAM: KEYS[:2], TierKind.SSD: []})
    assert Snapshot.decode(snap.encode()) == snap
    assert Locate.decode(Locate(7, tuple(KEYS[:4])).encode()) == Locate(7, tuple(KEYS[:4]))
    loc = Located((("a", "b"), ()), (("a", 1),))
    assert Located.decode(loc.encode()) == loc
    for bad in (b"\xc1", b"\x90", EventBatch("n1", 7, (ev,)).encode()[:-5]):
        with pytest.raises(ClusterError):
            EventBatch.decode(bad)


def test_a_record_of_another_kind_or_a_short_hash_is_refused_by_name():
    import msgspec
    import pytest
    from kvstore.cluster.messages import EventBatch, Locate
    from kvstore.cluster.records import ClusterError, NodeRecord
    with pytest.raises(ClusterError, match="Invalid value 'snapshot/2'"):
        EventBatch.decode(msgspec.msgpack.encode(["snapshot/2", "n1", 7, []]))
    with pytest.raises(ClusterError, match="length"):
        Locate.decode(Locate(7, (KEYS[0][:15],)).encode())
    rec = NodeRecord("n1", "127.0.0.1:1", "http://127.0.0.1:2")
    assert NodeRecord.decode(rec.encode()) == rec
    with pytest.raises(ClusterError, match="contain no '/'"):
        NodeRecord.decode(rec.encode().replace(b"n1", b"n/"))
