"""A worker's paged-cache KV events: real BlockPool changes become gap-free events that a
ClusterIndex applies to the same content; a reader that fell behind gets a snapshot."""
from engine_adapter.block_pool import BlockPool
from engine_adapter.serving.kv_events import CacheEventLog
from kvstore.events import MAX_BUFFERED, EventRing
from kvstore.cluster.messages import EventBatch, Snapshot
from kvstore.events import EventKind, KVEvent, TierKind
from kvstore.index import ClusterIndex


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def cache(pool: BlockPool, ids: list[int]) -> None:
    """Register blocks for hashes `ids` like a finished prefill does, then release them."""
    blocks = pool.allocate_n(len(ids))
    pool.cache_n(blocks, [h(i) for i in ids])
    pool.free_n(blocks)


def follow(log: CacheEventLog, index: ClusterIndex, after: int | None) -> int:
    """Apply what the log says after `after`; returns the seq to ask after next."""
    kind, body = log.read(after)
    if kind == "snapshot":
        snap = Snapshot.decode(body)
        index.apply_snapshot(snap.node_id, snap.seq, snap.blocks)
        return snap.seq
    for e in EventBatch.decode(body).events:
        index.apply(e)
    return index.next_seq("w0") - 1


def test_cached_then_evicted_blocks_come_and_go_in_the_index():
    pool, index = BlockPool(4), ClusterIndex()
    log = CacheEventLog("w0", 7, pool.cached)
    seq = follow(log, index, None)
    cache(pool, [1, 2, 3])
    log.update()
    seq = follow(log, index, seq)
    assert index.blocks_of("w0", TierKind.GPU) == {h(1), h(2), h(3)}
    cache(pool, [4, 5])  # the free block, then the chain's tail (3) are reallocated
    log.update()
    follow(log, index, seq)
    assert index.blocks_of("w0", TierKind.GPU) == set(pool.cached) == {h(1), h(2), h(4), h(5)}
    assert index.query([h(1), h(2), h(3)]).length("w0") == 2


def test_events_are_numbered_without_gaps_and_unchanged_caches_say_nothing():
    pool = BlockPool(8)
    log = CacheEventLog("w0", 7, pool.cached)
    for ids in ([1], [2, 3], [4, 5, 6, 7, 8, 9]):
        cache(pool, ids)
        log.update()
        log.update()  # nothing new
    kind, body = log.read(-1)
    events = EventBatch.decode(body).events
    assert kind == "events"
    assert [e.seq for e in events] == list(range(len(events)))
    assert {e.kind for e in events} == {EventKind.STORED, EventKind.REMOVED}


def test_a_reader_too_far_behind_gets_a_snapshot_of_the_cache():
    pool = BlockPool(2)
    log = CacheEventLog("w0", 7, pool.cached)
    for i in range(MAX_BUFFERED + 5):
        cache(pool, [i])
        log.update()
    kind, body = log.read(0)
    snap = Snapshot.decode(body)
    assert kind == "snapshot" and set(snap.blocks[TierKind.GPU]) == set(pool.cached)
    kind, _ = log.read(snap.seq)
    assert kind == "events"


def ev(seq: int) -> KVEvent:
    return KVEvent(EventKind.STORED, "pool", seq, TierKind.DRAM, (h(seq),))


def test_ring_forgets_everything_before_a_producer_gap():
    ring = EventRing()
    ring.extend([ev(0), ev(1)])
    assert [e.seq for e in ring.after(0)] == [1]
    ring.extend([ev(5)])  # 2..4 were lost on the way
    assert ring.after(1) is None and [e.seq for e in ring.after(4)] == [5]


def test_a_cursor_past_the_last_event_gets_a_snapshot():
    """A reader's cursor from before the producer restarted (its seqs begin again at 0)
    must not skip the new events numbered below it."""
    ring = EventRing()
    ring.extend([ev(0), ev(1)])
    assert [e.seq for e in ring.after(0)] == [1] and ring.after(1) == ()
    assert ring.after(57) is None
