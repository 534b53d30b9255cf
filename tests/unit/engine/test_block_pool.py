"""BlockPool: ref counts, the free queue, prefix-cache hits and lazy eviction order."""
from engine_adapter.block_pool import BlockPool

H = [bytes([i]) * 16 for i in range(8)]


def check_invariants(pool: BlockPool) -> None:
    free = list(pool.free_queue)
    assert len(free) == pool.num_free == sum(b.ref_cnt == 0 for b in pool.blocks)
    assert all(b.ref_cnt == 0 for b in free)
    for h, b in pool.cached.items():
        assert b.block_hash == h


def test_allocate_free_and_exhaustion():
    pool = BlockPool(4)
    a = pool.allocate_n(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1] and pool.num_free == 1
    assert pool.allocate_n(2) is None  # can't now: a value, not an error
    check_invariants(pool)
    pool.free_n(a)
    assert pool.num_free == 4
    check_invariants(pool)


def test_cached_blocks_hit_after_free_until_reallocated():
    pool = BlockPool(4)
    a = pool.allocate_n(3)
    pool.cache_n(a, H[:3])
    pool.free_n(a)  # freed tail first: a[2] is reallocated before a[1] before a[0]
    assert pool.get_cached_prefix(H[:4]) == a
    pool.touch(pool.get_cached_prefix(H[:2]))  # a hit takes free blocks out of the queue
    assert a[0].ref_cnt == a[1].ref_cnt == 1 and pool.num_free == 2
    check_invariants(pool)
    [b] = pool.allocate_n(1)
    assert b is pool.blocks[3]  # the never-used block was at the front
    [c] = pool.allocate_n(1)
    assert c is a[2] and c.block_hash is None and H[2] not in pool.cached  # evicted on reuse
    assert pool.get_cached_prefix(H[:3]) == a[:2]
    check_invariants(pool)


def test_shared_blocks_are_counted_and_a_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(4)
    a = pool.allocate_n(1)
    pool.cache_n(a, H[:1])
    pool.touch(a)
    assert a[0].ref_cnt == 2
    pool.free_n(a)
    assert pool.num_free == 3  # still held once
    b = pool.allocate_n(1)
    pool.cache_n(b, H[:1])
    assert pool.cached[H[0]] is a[0]
    check_invariants(pool)


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    a = pool.allocate_n(1)
    pool.cache_n(a, H[:1])
    assert pool.get_cached_prefix(H[:1]) == []


def test_unused_blocks_go_back_first_in_line_and_evict_no_cached_block():
    pool = BlockPool(4)
    a = pool.allocate_n(2)
    pool.cache_n(a, H[:2])
    pool.free_n(a)  # cached, free: next in line after the never-used blocks
    spare = pool.allocate_n(4)  # a speculative read's blocks, taken up front...
    assert H[0] not in pool.cached  # (taking a cached block drops its hash, as ever)
    pool.free_unused(spare[2:])  # ...the two it filled kept, two never filled given back
    check_invariants(pool)
    assert list(pool.free_queue) == spare[2:][::-1]
    pool.cache_n(spare[:2], H[2:4])
    pool.free_n(spare[:2])
    again = pool.allocate_n(2)  # the unfilled ones are reallocated before any cached one
    assert set(again) == set(spare[2:]) and pool.get_cached_prefix(H[2:4]) == spare[:2]
    check_invariants(pool)
