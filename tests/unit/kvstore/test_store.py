import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.config import StoreConfig, TierConfig
from kvstore.errors import (BlockSizeError, ConfigError, NamespaceMismatchError,
                            ReservationError, StoreClosedError, UnknownTierError)
from kvstore.events import EventKind, TierKind
from kvstore.keys import Namespace, hash_blocks
from kvstore.layout import encode_block
from kvstore.store import PutStatus, TieredStore
from kvstore.tiers import slabfile

NS = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
CHAIN = hash_blocks(NS, list(range(4 * 12)))
OTHER = hash_blocks(NS, list(range(1000, 1000 + 4 * 12)))


def blocks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NS.block_bytes), dtype=torch.uint8, generator=g)


def make(tmp_path, gpu=0, dram=4, ssd=0, **kw):
    tiers = []
    if gpu:
        tiers.append(TierConfig(TierKind.GPU, gpu, device="cpu"))
    if dram:
        tiers.append(TierConfig(TierKind.DRAM, dram))
    if ssd:
        tiers.append(TierConfig(TierKind.SSD, ssd, path=str(tmp_path / "ssd")))
    return TieredStore(NS, StoreConfig(tuple(tiers), **kw))


def read(store, hashes):
    out = torch.zeros(len(hashes), NS.block_bytes, dtype=torch.uint8)
    return store.get_n(hashes, out), out


def test_put_get_every_buffer_form(tmp_path):
    with make(tmp_path, dram=8) as s:
        data = blocks(4)
        assert s.put_n(CHAIN[:2], data[:2]) == [PutStatus.STORED] * 2          # one buffer
        assert s.put_n(CHAIN[2:3], [data[2].numpy()]) == [PutStatus.STORED]    # numpy
        assert s.put_n(CHAIN[3:4], [bytes(data[3].numpy())]) == [PutStatus.STORED]  # bytes
        tiers, out = read(s, CHAIN[:4])
        assert tiers == [TierKind.DRAM] * 4 and torch.equal(out, data)
        typed = torch.zeros((2,) + NS.block_shape, dtype=torch.float16)     # model-dtype dst
        assert s.get_n(CHAIN[:2], typed) == [TierKind.DRAM] * 2
        assert torch.equal(typed.view(torch.uint8).reshape(2, -1), data[:2])
        dst = [bytearray(NS.block_bytes)]
        assert s.get_n(CHAIN[3:4], dst) == [TierKind.DRAM] and bytes(dst[0]) == bytes(data[3].numpy())


def test_put_of_an_existing_hash_is_a_noop(tmp_path):
    with make(tmp_path) as s:
        s.put_n(CHAIN[:1], blocks(1, seed=1))
        assert s.put_n(CHAIN[:1], blocks(1, seed=2)) == [PutStatus.EXISTS]
        assert s.put_n([CHAIN[1], CHAIN[1]], blocks(2)) == [PutStatus.STORED, PutStatus.EXISTS]
        assert torch.equal(read(s, CHAIN[:1])[1], blocks(1, seed=1))


def test_misses_are_values(tmp_path):
    with make(tmp_path) as s:
        s.put_n(CHAIN[:1], blocks(1))
        assert read(s, [CHAIN[0], OTHER[0]])[0] == [TierKind.DRAM, None]
        assert s.contains_n([OTHER[0], CHAIN[0]]) == [False, True]
        assert s.stats().misses == 1


def test_match_prefix_stops_at_the_first_gap(tmp_path):
    with make(tmp_path, dram=3, ssd=8) as s:
        s.put_n(CHAIN[:5], blocks(5))
        s.put_n(CHAIN[6:7], blocks(1))
        m = s.match_prefix(CHAIN[:8])
        assert m.num_blocks == 5
        assert sorted(m.tiers) == [TierKind.DRAM] * 2 + [TierKind.SSD] * 3
        assert s.match_prefix(OTHER).num_blocks == 0


def test_bad_sizes_are_refused_and_nothing_is_stored(tmp_path):
    with make(tmp_path) as s:
        with pytest.raises(BlockSizeError, match="bytes"):
            s.put_n(CHAIN[:2], blocks(2)[:, :-1].contiguous())
        with pytest.raises(BlockSizeError, match="buffer 1"):
            s.put_n(CHAIN[:2], [blocks(1)[0], b"short"])
        with pytest.raises(BlockSizeError, match="2 buffers for 3"):
            s.put_n(CHAIN[:3], list(blocks(2)))
        with pytest.raises(TypeError, match="read-only"):
            s.get_n(CHAIN[:1], [b"\0" * NS.block_bytes])
        with pytest.raises(ValueError, match="16 bytes"):
            s.put_n([b"short"], blocks(1))
        assert s.stats().tier(TierKind.DRAM).used_blocks == 0


def test_encoded_blocks_of_another_namespace_are_refused(tmp_path):
    other = Namespace(**{**NS.__dict__, "tenant": "someone-else"})
    with make(tmp_path) as s:
        good = encode_block(NS, CHAIN[0], blocks(1)[0])
        assert s.put_encoded_n([good]) == [PutStatus.STORED]
        with pytest.raises(NamespaceMismatchError):
            s.put_encoded_n([encode_block(other, OTHER[0], blocks(1)[0])])
        assert s.contains_n([OTHER[0]]) == [False]


def test_config_errors():
    with pytest.raises(UnknownTierError, match="choose from gpu, dram, ssd"):
        TierConfig("nvme", 4)
    with pytest.raises(ConfigError, match="fastest first"):
        StoreConfig((TierConfig("ssd", 4, path="/tmp/x"), TierConfig("dram", 4)))
    with pytest.raises(ConfigError, match="needs a path"):
        TierConfig("ssd", 4)
    with pytest.raises(ConfigError, match="watermarks"):
        TierConfig("dram", 4, high_watermark=0.5, low_watermark=0.9)
    for cap in (2.5, True, "3", 0):
        with pytest.raises(ConfigError, match="whole number of blocks"):
            TierConfig("dram", cap)
    assert TierConfig("dram", np.int64(3)).capacity_blocks == 3
    for bad in (dict(reservation_timeout_s=float("nan")), dict(reservation_timeout_s=0),
                dict(background_interval_s=0), dict(event_buffer=0)):
        with pytest.raises(ConfigError, match=next(iter(bad))):  # NaN: never reclaimed
            StoreConfig((TierConfig("dram", 4),), **bad)


def test_closed_store_refuses_work(tmp_path):
    s = make(tmp_path)
    s.close()
    for call in (lambda: read(s, CHAIN[:1]), lambda: s.put_n(CHAIN[:1], blocks(1)),
                 lambda: s.contains_n(CHAIN[:1]), lambda: s.match_prefix(CHAIN[:1])):
        with pytest.raises(StoreClosedError, match="closed"):
            call()
    s.close()


def test_eviction_takes_the_tail_of_a_chain_first(tmp_path):
    with make(tmp_path, dram=4) as s:
        s.put_n(CHAIN[:4], blocks(4))
        s.put_n(OTHER[:1], blocks(1))             # full: one block must go
        assert s.contains_n(CHAIN[:4]) == [True, True, True, False]
        s.put_n(OTHER[1:3], blocks(2))
        assert s.contains_n(CHAIN[:4]) == [True, False, False, False]
        assert s.stats().tier(TierKind.DRAM).counters.evictions == 3


def test_recently_read_blocks_stay(tmp_path):
    with make(tmp_path, dram=4) as s:
        s.put_n(CHAIN[:2], blocks(2))
        s.put_n(OTHER[:2], blocks(2))
        read(s, CHAIN[:2])                          # CHAIN is now the most recent
        s.put_n(OTHER[2:4], blocks(2))
        assert s.contains_n(CHAIN[:2]) == [True, True]
        assert s.contains_n(OTHER[:2]) == [False, False]


def test_eviction_demotes_down_the_tiers_and_drops_from_the_last(tmp_path):
    with make(tmp_path, gpu=2, dram=2, ssd=2) as s:
        data = blocks(7)
        s.put_n(CHAIN[:6], data[:6])
        assert s.stats().tier(TierKind.SSD).used_blocks == 2
        s.drain_events()
        s.put_n(CHAIN[6:7], data[6:7])
        st = s.stats()
        assert [t.used_blocks for t in st.tiers] == [2, 2, 2]
        assert st.tier(TierKind.SSD).counters.evictions == 1
        assert st.tier(TierKind.GPU).counters.demotions_out == 1
        kinds = [(e.kind, e.tier) for e in s.drain_events()]
        assert (EventKind.REMOVED, TierKind.SSD) in kinds and (EventKind.STORED, TierKind.DRAM) in kinds
        present = [h for h in CHAIN[:7] if s.contains_n([h])[0]]
        tiers, out = read(s, present)
        assert all(t is not None for t in tiers)
        for h, row in zip(present, out):
            assert torch.equal(row, data[CHAIN.index(h)])


def test_a_hit_in_a_lower_tier_is_promoted(tmp_path):
    with make(tmp_path, dram=2, ssd=4) as s:
        s.put_n(CHAIN[:2], blocks(2))
        s.put_n(OTHER[:2], blocks(2, seed=3))       # CHAIN -> SSD
        assert s.match_prefix(CHAIN[:2]).tiers == (TierKind.SSD,) * 2
        tiers, out = read(s, CHAIN[:2])
        assert tiers == [TierKind.SSD] * 2 and torch.equal(out, blocks(2))
        assert s.match_prefix(CHAIN[:2]).tiers == (TierKind.DRAM,) * 2
        assert s.match_prefix(OTHER[:2]).tiers == (TierKind.SSD,) * 2
        assert s.stats().tier(TierKind.DRAM).counters.promotions_in == 2


def test_promotion_can_be_switched_off(tmp_path):
    with make(tmp_path, dram=2, ssd=4, promote_on_hit=False) as s:
        s.put_n(CHAIN[:2], blocks(2))
        s.put_n(OTHER[:2], blocks(2))
        read(s, CHAIN[:2])
        assert s.match_prefix(CHAIN[:2]).tiers == (TierKind.SSD,) * 2


def test_a_full_store_of_pinned_blocks_says_no_space(tmp_path):
    with make(tmp_path, dram=2) as s:
        s.put_n(CHAIN[:2], blocks(2))
        assert s.pin_n(CHAIN[:2] + OTHER[:1]) == [True, True, False]
        assert s.put_n(OTHER[:1], blocks(1)) == [PutStatus.NO_SPACE]
        assert s.contains_n(CHAIN[:2]) == [True, True]
        s.unpin_n(CHAIN[1:2])
        assert s.put_n(OTHER[:1], blocks(1)) == [PutStatus.STORED]
        assert s.contains_n(CHAIN[:2]) == [True, False]


@pytest.mark.parametrize("ssd", [0, 8])
def test_single_block_puts_evict_as_the_batch_path_would(tmp_path, monkeypatch, ssd):
    """A single block's put takes a short path (`TierMap.allocate_one`): it leaves the same
    blocks in the same tiers, evicts the same ones, and says the same in events as the
    general allocation does."""
    from kvstore.tiermap import TierMap
    outcomes = []
    for mode in ("short", "general"):
        if mode == "general":
            monkeypatch.setattr(TierMap, "allocate_one",
                                lambda self: (self.allocate(1, demote=False) or [None])[0])
        with make(tmp_path / mode, dram=3, ssd=ssd) as s:
            s.put_n(CHAIN[:3], blocks(3))  # the batch's tail is the oldest
            s.pin_n(CHAIN[1:2])
            s.pin_n(CHAIN[2:3], ttl_s=0.01)
            time.sleep(0.05)  # lapsed, not yet expired: its block stays out of the LRU
            got = [s.put_n([h], blocks(1, i))[0] for i, h in enumerate(OTHER[:4])]
            kept = s.contains_n(CHAIN[:3] + OTHER[:4])
            where = [s.match_prefix([h]).tiers for h in CHAIN[:3] + OTHER[:4]]
            events = [(e.kind, e.tier, e.block_hashes) for e in s.drain_events()]
            outcomes.append((got, kept, where, events))
    assert outcomes[0] == outcomes[1]
    got, kept, _, _ = outcomes[0]
    assert got == [PutStatus.STORED] * 4
    if ssd:
        assert all(kept)
    else:  # the LRU block, then each new one in turn; the pinned ones stay
        assert kept == [False, True, True, False, False, False, True]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seed", [1, 11])
@pytest.mark.parametrize("tiers", [dict(dram=4), dict(dram=0, ssd=4), dict(dram=3, ssd=5),
                                   dict(gpu=2, dram=2, ssd=4)])
def test_the_single_block_path_matches_the_general_one_step_by_step(tmp_path, monkeypatch,
                                                                     tiers, seed):
    """Two stores, one taking the single-block path and one the general allocation for every
    put, driven in lockstep by the same random steps (single and batch puts, reservations of
    an outside writer left to expire, pins hard and soft, reads, evictions, maintenance) on
    one fake clock: after every step they answer, hold, order and report the same."""
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    rng = np.random.default_rng(seed)
    stores = [make(tmp_path / "short", **tiers), make(tmp_path / "general", **tiers)]
    general = stores[1]
    general._reserve_one = lambda h, timeout, owner: general._reserve_locked([h], timeout, owner)
    owner, pool = object(), CHAIN[:10] + OTHER[:10]
    data = blocks(3, 5)

    def state(s):
        p = s._p
        return (sorted((bytes(e.hash), e.tier, e.slot, e.state.value, e.hard_pins)
                       for e in p.entries.values()),
                [list(lru) for lru in p.lru], [t.num_free() for t in p.tiers],
                [(e.kind, e.tier, e.block_hashes) for e in s.drain_events()],
                s.num_quarantined(owner), s.stats().open_reservations)

    try:
        for step in range(600):
            op = int(rng.integers(0, 9))
            picks = [pool[i] for i in rng.integers(0, len(pool), size=3)]
            one = [memoryview(picks[0])] if step % 2 else picks[:1]  # (any buffer as a hash)
            ttl = float(rng.integers(1, 4)) if step % 3 else None  # (hard pins: None)
            commit = bool(rng.integers(0, 2))  # else left open, to expire
            answers = []
            for s in stores:
                if op <= 2:
                    answers.append(s.put_n(one, data[:1]))
                elif op == 3:
                    answers.append(s.put_n(picks, data))
                elif op == 4:
                    res = s.reserve_n(one, timeout_s=5.0, owner=owner)
                    answers.append((res.statuses, res.slots))
                    if commit:
                        s.commit(res.reservation_id)
                elif op == 5:
                    answers.append(s.pin_n(one, ttl_s=ttl))
                elif op == 6:
                    answers.append(read(s, picks[:2])[0])
                elif op == 7:
                    s.unpin_n(one)
                    answers.append(s.evict_n(picks[1:2]))
                else:
                    answers.append(s.maintain())
            if op == 8:
                clock.now += float(rng.integers(1, 4))  # soft pins and reservations lapse
            assert answers[0] == answers[1], f"step {step}: op {op} answered apart"
            assert state(stores[0]) == state(stores[1]), f"step {step}: op {op} left them apart"
    finally:
        for s in stores:
            s.close(flush=False)


def test_single_block_put_with_nothing_evictable_is_no_space_and_costs_nothing(tmp_path):
    owner = object()
    with make(tmp_path, dram=1) as s:
        s.put_n(CHAIN[:1], blocks(1))
        s.pin_n(CHAIN[:1])
        res = s.reserve_n(OTHER[:1], owner=owner)
        assert res.statuses == (PutStatus.NO_SPACE,) and res.slots == (None,)
        s.commit(res.reservation_id)  # (nothing to commit, but the id was open)
        assert s.contains_n(CHAIN[:1] + OTHER[:1]) == [True, False]
        assert s.stats().open_reservations == 0


def test_hard_pins_are_counted(tmp_path):
    with make(tmp_path, dram=1) as s:
        s.put_n(CHAIN[:1], blocks(1))
        s.pin_n(CHAIN[:1])
        s.pin_n(CHAIN[:1])
        s.unpin_n(CHAIN[:1])
        assert s.put_n(OTHER[:1], blocks(1)) == [PutStatus.NO_SPACE]


def test_soft_pins_expire(tmp_path):
    with make(tmp_path, dram=2) as s:
        s.put_n(CHAIN[:2], blocks(2))
        s.pin_n(CHAIN[:1], ttl_s=3600)
        s.pin_n(CHAIN[1:2], ttl_s=0.01)
        time.sleep(0.05)
        assert s.put_n(OTHER[:1], blocks(1)) == [PutStatus.STORED]
        assert s.contains_n(CHAIN[:2]) == [True, False]


def test_a_leased_block_is_not_evicted_until_released(tmp_path):
    with make(tmp_path, dram=2) as s:
        s.put_n(CHAIN[:2], blocks(2))
        lease = s.acquire_n([CHAIN[0], CHAIN[1], OTHER[0]])
        assert lease.hits[2] is None and lease.hits[0][0] is TierKind.DRAM
        assert s.put_n(OTHER[:1], blocks(1)) == [PutStatus.NO_SPACE]
        s.release(lease.lease_id)
        assert s.put_n(OTHER[:1], blocks(1)) == [PutStatus.STORED]


def test_an_expired_lease_is_reclaimed(tmp_path):
    with make(tmp_path, dram=1) as s:
        s.put_n(CHAIN[:1], blocks(1))
        s.acquire_n(CHAIN[:1], ttl_s=0.01)
        time.sleep(0.05)
        s.maintain()
        assert s.stats().open_leases == 0
        assert s.put_n(OTHER[:1], blocks(1)) == [PutStatus.STORED]


def test_two_phase_put(tmp_path):
    with make(tmp_path, dram=4) as s:
        res = s.reserve_n(CHAIN[:2])
        assert res.statuses == (PutStatus.STORED,) * 2
        assert s.contains_n(CHAIN[:2]) == [False, False]            # invisible before commit
        s.write_reserved(res, blocks(2))
        s.commit(res.reservation_id)
        assert torch.equal(read(s, CHAIN[:2])[1], blocks(2))
        with pytest.raises(ReservationError, match="unknown"):
            s.commit(res.reservation_id)
        res = s.reserve_n(OTHER[:2])
        s.abort(res.reservation_id)
        assert s.stats().tier(TierKind.DRAM).used_blocks == 2


def test_a_writer_that_never_commits_is_reclaimed(tmp_path):
    with make(tmp_path, dram=2) as s:
        res = s.reserve_n(CHAIN[:2], timeout_s=0.01)
        time.sleep(0.05)
        s.maintain()
        assert s.stats().tier(TierKind.DRAM).used_blocks == 0
        with pytest.raises(ReservationError, match="timeout"):
            s.commit(res.reservation_id)
        assert s.put_n(CHAIN[:2], blocks(2)) == [PutStatus.STORED] * 2


def test_the_dram_slots_of_an_outside_writer_stay_taken_until_it_is_done(tmp_path):
    """A reservation made for a writer outside the store (a same-host client filling its
    DRAM slots itself) is reclaimed at its timeout like any other, but its DRAM slots are
    handed out again only once the writer says it is done (or is gone): the hashes are free
    at once, the SSD slots too (only the daemon writes those)."""
    owner = object()
    with make(tmp_path, dram=2, ssd=4) as s:
        res = s.reserve_n(CHAIN[:2], timeout_s=0.01, owner=owner)
        assert {kind for kind, _ in res.slots} == {TierKind.DRAM}
        time.sleep(0.05)
        s.maintain()
        assert s.stats().open_reservations == 0
        dram = s.tier(TierKind.DRAM)
        assert dram.num_free() == 0  # still the late writer's
        assert s.put_n(CHAIN[:2], blocks(2)) == [PutStatus.STORED] * 2  # (to SSD)
        assert s.stats().tier(TierKind.SSD).used_blocks == 2
        assert s.release_owned(owner, res.reservation_id)
        assert dram.num_free() == 2 and not s.release_owned(owner, res.reservation_id)
        res = s.reserve_n(OTHER[:2], timeout_s=0.01, owner=owner)
        time.sleep(0.05)
        s.maintain()
        assert dram.num_free() == 0
        s.end_owner(owner)  # its connection closed
        assert dram.num_free() == 2
        kept = s.reserve_n(OTHER[2:4], timeout_s=60, owner=owner)
        s.keep_reservation(kept.reservation_id)  # being filled: no timeout any more
        s.end_owner(owner)
        s.commit(kept.reservation_id)
        assert read(s, OTHER[2:4])[0] == [TierKind.DRAM] * 2


def test_watermarks_demote_in_the_background(tmp_path):
    with make(tmp_path, dram=10, ssd=20, background_interval_s=0.01) as s:
        cfg = s.config.tiers[0]
        s.put_n(CHAIN[:10], blocks(10))
        deadline = time.monotonic() + 10
        while s.stats().tier(TierKind.DRAM).used_blocks > cfg.low_watermark * 10:
            assert time.monotonic() < deadline, "background maintenance never ran"
            time.sleep(0.01)
        assert s.stats().tier(TierKind.SSD).used_blocks >= 1
        assert all(t is not None for t in read(s, CHAIN[:10])[0])


def test_maintenance_writes_what_the_ssd_index_has_queued(tmp_path):
    """SSD index entries and deletes wait in a queue for a group's worth (see
    kvstore.tiers.ssdindex); a maintenance pass writes them, so a store that goes quiet
    leaves its index complete (a later open then adopts nothing from the headers)."""
    with make(tmp_path, dram=0, ssd=8) as s:
        s.put_n(CHAIN[:3], blocks(3))
        s.remove_n(CHAIN[:1])  # an explicit remove writes the queue at once
        index = s.tier(TierKind.SSD).index
        assert index.num_queued == 0
        s.put_n(CHAIN[3:5], blocks(2, seed=1))
        assert index.num_queued == 2
        s.maintain()
        assert index.num_queued == 0
        listed = set(s.tier(TierKind.SSD).raw_db().keys())
        assert listed == {bytes(h) for h in CHAIN[1:5]}


def test_a_corrupted_ssd_value_is_a_miss_and_is_removed(tmp_path):
    with make(tmp_path, dram=1, ssd=4) as s:
        data = blocks(3)
        s.put_n(CHAIN[:3], data)
        ssd = s.tier(TierKind.SSD)
        key = next(bytes(h) for h in CHAIN[:3] if ssd.locate(h) is not None)
        path, offset = ssd.locate(key)
        with open(path, "r+b") as f:  # flip a payload byte on disk
            f.seek(offset + 3)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        tiers, out = read(s, CHAIN[:3])
        bad = CHAIN.index(key)
        assert tiers[bad] is None and all(t is not None for i, t in enumerate(tiers) if i != bad)
        assert s.contains_n([key]) == [False]
        assert s.stats().tier(TierKind.SSD).counters.corrupt == 1
        for i in range(3):
            if i != bad:
                assert torch.equal(out[i], data[i])


def test_close_flushes_memory_tiers_and_reopen_finds_every_block(tmp_path):
    s = make(tmp_path, gpu=2, dram=2, ssd=8)
    data = blocks(6)
    s.put_n(CHAIN[:6], data)
    s.pin_n(CHAIN[:1])
    s.close()
    s = make(tmp_path, gpu=2, dram=2, ssd=8)
    assert s.match_prefix(CHAIN[:6]).num_blocks == 6
    tiers, out = read(s, CHAIN[:6])
    assert torch.equal(out, data)
    s.close()


def test_flush_keeps_the_hottest_prefix_when_ssd_is_small(tmp_path):
    s = make(tmp_path, gpu=2, dram=3, ssd=4)
    s.put_n(CHAIN[:9], blocks(9))
    s.close()
    s = make(tmp_path, gpu=2, dram=3, ssd=4)
    assert s.match_prefix(CHAIN[:9]).num_blocks == 4
    s.close()


def test_events_are_numbered_without_gaps(tmp_path):
    with make(tmp_path, dram=2, ssd=2, node_id="n1") as s:
        s.put_n(CHAIN[:5], blocks(5))
        read(s, CHAIN[:5])
        events = s.drain_events()
        assert [e.seq for e in events] == list(range(len(events)))
        assert all(e.node_id == "n1" for e in events)
        live = set()
        for e in events:
            for h in e.block_hashes:
                (live.add if e.kind is EventKind.STORED else live.discard)((e.tier, h))
        now = {(t, h) for h, t in zip(CHAIN[:5], s.match_prefix(CHAIN[:5]).tiers)}
        assert {h for _, h in live} == {h for h in CHAIN[:5] if s.contains_n([h])[0]}
        assert now <= live


def test_a_second_process_reads_a_leased_block_from_the_dram_arena(tmp_path):
    with make(tmp_path, dram=4) as s:
        data = blocks(3, seed=9)
        s.put_n(CHAIN[:3], data)
        lease = s.acquire_n(CHAIN[2:3])
        kind, slot = lease.hits[0]
        arena_fd, dir_fd = s.tier(TierKind.DRAM).share_fds()  # as the daemon hands them out
        code = ("import sys; from kvstore.arena_layout import DramArenaReader; "
                "r = DramArenaReader(int(sys.argv[1])); "
                "sys.stdout.buffer.write(r.read(int(sys.argv[2])))")
        try:
            got = subprocess.run([sys.executable, "-c", code, str(arena_fd), str(slot)],
                                 capture_output=True, check=True, pass_fds=(arena_fd,)).stdout
        finally:
            os.close(arena_fd)
            os.close(dir_fd)
        s.release(lease.lease_id)
        assert kind is TierKind.DRAM and got == data[2].numpy().tobytes()


def test_concurrent_readers_and_writers_see_exact_bytes(tmp_path):
    with make(tmp_path, dram=16, ssd=64) as s:
        errors, statuses = [], []

        def worker(k):
            try:
                rng = np.random.default_rng(k)
                hashes = hash_blocks(NS, list(range(k * 10_000, k * 10_000 + 4 * 20)))
                payload = {h: rng.integers(0, 256, NS.block_bytes, dtype=np.uint8) for h in hashes}
                for i in range(0, 20, 4):
                    statuses.extend(s.put_n(hashes[i:i + 4], [payload[h] for h in hashes[i:i + 4]]))
                    got, out = read(s, hashes[:i + 4])
                    for h, t, row in zip(hashes, got, out):
                        if t is not None and not np.array_equal(row.numpy(), payload[h]):
                            errors.append(f"wrong bytes for worker {k}")
            except Exception as e:  # surfaced below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        # 80 blocks for 80 slots while readers hold leases: a block may be dropped (from
        # either tier) or, if every slot is held at that moment, refused, never lost
        st = s.stats()
        stored = statuses.count(PutStatus.STORED)
        assert stored + statuses.count(PutStatus.NO_SPACE) == 80
        assert sum(t.used_blocks + t.counters.evictions for t in st.tiers) == stored


def test_remove_and_clear(tmp_path):
    with make(tmp_path, dram=2, ssd=4) as s:
        s.put_n(CHAIN[:5], blocks(5))
        s.pin_n(CHAIN[:1])
        lease = s.acquire_n(CHAIN[1:2])
        assert s.remove_n([CHAIN[0], CHAIN[1], CHAIN[2], OTHER[0]]) == 2   # the leased one stays
        assert s.contains_n(CHAIN[:5]) == [False, True, False, True, True]
        assert sorted(s.list_hashes()) == sorted([CHAIN[1], CHAIN[3], CHAIN[4]])
        s.release(lease.lease_id)
        assert s.clear() == 3 and s.list_hashes() == []
        assert sum(t.used_blocks for t in s.stats().tiers) == 0
        assert s.put_n(CHAIN[:2], blocks(2)) == [PutStatus.STORED] * 2


def test_an_acknowledged_remove_leaves_no_index_entry_behind_a_promotion(tmp_path):
    """A block promoted out of SSD leaves its index entry's delete queued; removed from
    DRAM later, the remove must write that delete too. Left queued, a crash kept the entry,
    and a lost header file's rebuild from the index brought the removed block back."""
    with make(tmp_path, dram=2, ssd=8, promote_on_hit=True) as s:
        s.put_n(CHAIN[:1], blocks(1))
        assert s.evict_n(CHAIN[:1]) == 1  # down to SSD
        s.maintain()  # its entry written
        ssd = s.tier(TierKind.SSD)
        assert CHAIN[0] in list(ssd.raw_db().keys())
        assert s.get_n(CHAIN[:1], torch.empty(1, NS.block_bytes, dtype=torch.uint8)) == \
            [TierKind.SSD]
        assert s.contains_n(CHAIN[:1]) == [True]  # (promoted: in DRAM now)
        assert s.remove_n(CHAIN[:1]) == 1
        assert CHAIN[0] not in list(ssd.raw_db().keys())


def test_a_promotion_never_costs_the_store_a_block(tmp_path):
    """Hits in SSD promoted into a full DRAM: its victims go down into the SSD's free
    slots, and no further. They were made room for by dropping SSD blocks while the
    promoted ones still held their SSD slots: a read of 6 blocks lost 2 others from a
    store 12/16 full."""
    hs = hash_blocks(NS, list(range(12 * 4)))
    with make(tmp_path, dram=6, ssd=10, promote_on_hit=True) as s:
        assert s.put_n(hs, blocks(12)) == [PutStatus.STORED] * 12
        on_ssd = s.snapshot()[1][TierKind.SSD]
        assert len(on_ssd) == 6
        assert s.get_n(on_ssd, torch.empty(6, NS.block_bytes, dtype=torch.uint8)) == \
            [TierKind.SSD] * 6
        assert s.contains_n(hs) == [True] * 12
        in_dram = set(s.snapshot()[1][TierKind.DRAM])
        assert len(in_dram) == 6 and len(in_dram & set(on_ssd)) == 4  # as many as SSD had
        tiers, out = read(s, hs)  # room for below; every byte where it was
        assert None not in tiers and torch.equal(out, blocks(12))


def test_every_call_checks_its_hashes_and_a_soft_pin_its_ttl(tmp_path):
    """The in-process store answered a 3-byte hash False / 0 where the clients raise, and
    a soft pin of ttl -5 or NaN said True having pinned nothing (and one of ttl inf never
    ended)."""
    with make(tmp_path, dram=2) as s:
        s.put_n(CHAIN[:1], blocks(1))
        for call in (s.contains_n, s.match_prefix, s.pin_n, s.unpin_n, s.evict_n, s.remove_n):
            with pytest.raises(ValueError, match="16 bytes"):
                call([CHAIN[0], b"abc"])
        for ttl in (-5.0, 0.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="ttl_s"):
                s.pin_n(CHAIN[:1], ttl_s=ttl)
        assert s.pin_n(CHAIN[:1], ttl_s=5.0) == [True] and s.contains_n(CHAIN[:1]) == [True]


def test_a_meta_tensor_is_no_buffer(tmp_path):
    """A meta tensor has no storage: a get "into" it reported a hit with nothing copied."""
    with make(tmp_path, dram=2) as s:
        s.put_n(CHAIN[:1], blocks(1))
        meta = torch.empty(1, NS.block_bytes, dtype=torch.uint8, device="meta")
        for call in (lambda: s.get_n(CHAIN[:1], meta), lambda: s.get_n(CHAIN[:1], [meta[0]]),
                     lambda: s.put_n(CHAIN[1:2], meta)):
            with pytest.raises(BlockSizeError, match="meta tensor"):
                call()
        assert s.contains_n(CHAIN[1:2]) == [False]


def test_leases_count_as_reads(tmp_path):
    with make(tmp_path, dram=2) as s:
        s.put_n(CHAIN[:1], blocks(1))
        s.release(s.acquire_n([CHAIN[0], OTHER[0]]).lease_id)
        st = s.stats()
        assert st.tier(TierKind.DRAM).counters.hits == 1 and st.misses == 1
        assert st.tier(TierKind.DRAM).counters.bytes_out == NS.block_bytes


def test_snapshot_then_events_rebuild_the_content(tmp_path):
    with make(tmp_path, dram=2, ssd=6) as s:
        s.put_n(CHAIN[:4], blocks(4))
        seq, content = s.snapshot()
        assert s.drain_events() == []
        assert sorted(content[TierKind.DRAM] + content[TierKind.SSD]) == sorted(CHAIN[:4])
        s.put_n(CHAIN[4:6], blocks(2))
        s.remove_n(CHAIN[:1])
        events = s.drain_events()
        assert events[0].seq == seq + 1
        live = {(t, h) for t, hs in content.items() for h in hs}
        for e in events:
            for h in e.block_hashes:
                (live.add if e.kind is EventKind.STORED else live.discard)((e.tier, h))
        assert {h for _, h in live} == set(s.list_hashes())


def test_demotion_copies_outside_the_store_lock(tmp_path):
    """While a put's victims are being written to SSD, every other call on the store goes
    on: the SSD write of a demotion runs with the lock released (two-phase)."""
    from kvstore.tiers.ssd import SsdTier
    entered, release = threading.Event(), threading.Event()

    class GatedSsd(SsdTier):  # the real SSD tier, its writes held at a gate by the test
        def write_n(self, slots, hashes, srcs):
            entered.set()
            assert release.wait(30)
            super().write_n(slots, hashes, srcs)

    s = make(tmp_path, dram=2, ssd=8)
    gated = GatedSsd(NS, str(tmp_path / "gated"), 8)
    s._p.tiers[1].close()
    s._p.tiers[1] = gated
    try:
        data = blocks(3)
        s.put_n(CHAIN[:2], data[:2])  # DRAM full
        putter = threading.Thread(target=s.put_n, args=(CHAIN[2:3], data[2:3]))
        putter.start()
        assert entered.wait(30), "the put never demoted"
        out = torch.zeros(1, NS.block_bytes, dtype=torch.uint8)
        victim_or_not = s.get_n(CHAIN[:2], torch.zeros(2, NS.block_bytes, dtype=torch.uint8))
        assert victim_or_not == [TierKind.DRAM] * 2  # the victim is still readable where it was
        assert s.contains_n(CHAIN[:3]) == [True, True, False]
        release.set()
        putter.join(30)
        assert s.get_n(CHAIN[2:3], out) == [TierKind.DRAM] and torch.equal(out[0], data[2])
        tiers = s.match_prefix(CHAIN[:3]).tiers
        assert sorted(tiers) == [TierKind.DRAM, TierKind.DRAM, TierKind.SSD]
    finally:
        release.set()
        s.close()


def test_touch_counts_reads_and_orders_recency_across_chunks(tmp_path, monkeypatch):
    """`touch_n` (a same-host reader's report of its own copies) counts each block's reads,
    skips blocks gone meanwhile, and leaves the first block the most recent, however many
    lock visits (chunks) the report takes."""
    import kvstore.reads
    monkeypatch.setattr(kvstore.reads, "TOUCH_CHUNK", 2)
    with make(tmp_path, dram=4) as s:
        s.put_n(CHAIN[:4], blocks(4))
        assert s.touch_n([CHAIN[0], CHAIN[1], OTHER[0], CHAIN[2]], [3, 1, 9, 2]) == 6
        assert s.stats().tiers[0].counters.hits == 6
        assert s.touch_n(CHAIN[3:4]) == 1  # counts default to one read each
        assert s.touch_n(CHAIN[:3]) == 3
        s.put_n(OTHER[1:3], blocks(2, seed=1))  # two blocks evicted: the least recent
        assert s.contains_n(CHAIN[:4]) == [True, True, False, False]


def test_fetch_copies_a_window_and_defers_the_rest_held_until_read(tmp_path):
    """fetch_n(max_copied=k): DRAM blocks leased, the first k others copied, the rest held
    in the lease (DEFERRED) and counted as hits; read_deferred copies them exactly, takes
    them out of the lease, and a held block is never evicted meanwhile."""
    from kvstore.errors import LeaseError
    from kvstore.reads import DEFERRED, NO_SLOT
    with make(tmp_path, dram=2, ssd=8, promote_on_hit=False) as s:
        data = blocks(8, seed=3)
        s.put_n(CHAIN[:8], data)  # the 6 oldest demoted to SSD
        where = [s.match_prefix([h]).tiers[0] for h in CHAIN[:8]]
        ssd = [i for i, t in enumerate(where) if t is TierKind.SSD]
        rows = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)  # the k-th copied in row k
        hits_before = s.stats().tier(TierKind.SSD).counters.hits
        lease = s.fetch_n(CHAIN[:8], rows, lease_tier=TierKind.DRAM, max_copied=2)
        slots = [h[1] for h in lease.hits]
        assert [slots[i] for i in ssd] == [NO_SLOT, NO_SLOT] + [DEFERRED] * (len(ssd) - 2)
        assert all(slots[i] >= 0 for i in range(8) if i not in ssd)
        assert [i for i, c in enumerate(lease.copied) if c] == ssd[:2]
        assert all(torch.equal(rows[k], data[i]) for k, i in enumerate(ssd[:2]))
        assert s.stats().tier(TierKind.SSD).counters.hits == hits_before + len(ssd)
        later = ssd[2:]
        s.put_n(OTHER[:6], blocks(6, seed=4))  # pressure: held blocks must stay put
        window = torch.zeros(len(later), NS.block_bytes, dtype=torch.uint8)
        assert s.read_deferred(lease.lease_id, [CHAIN[i] for i in later], window) == [True] * len(later)
        assert all(torch.equal(window[k], data[i]) for k, i in enumerate(later))
        with pytest.raises(LeaseError, match="not held"):
            s.read_deferred(lease.lease_id, [CHAIN[later[0]]], window[:1])
        s.release(lease.lease_id)
        assert s.stats().open_leases == 0


def test_lease_n_leases_a_dram_batch_in_one_visit_and_leaves_any_other_alone(tmp_path):
    """lease_n: every hit in DRAM -> leased (slots to copy), hits and misses counted once;
    a block elsewhere -> None, with nothing held or counted (fetch_n then copies it)."""
    with make(tmp_path, dram=4, ssd=8, promote_on_hit=False) as s:
        data = blocks(6, seed=6)
        s.put_n(CHAIN[:6], data)  # the oldest demoted to SSD
        before = s.stats()
        assert s.lease_n(CHAIN[:6]) is None  # some of them are on SSD
        after = s.stats()
        assert (after.misses, after.tier(TierKind.DRAM).counters.hits) == \
            (before.misses, before.tier(TierKind.DRAM).counters.hits)
        assert after.open_leases == 0 and s.remove_n(CHAIN[:1]) == 1, "nothing left held"
        where = [s.match_prefix([h]).tiers[0] if s.contains_n([h])[0] else None
                 for h in CHAIN[:6]]
        a, b = [i for i, t in enumerate(where) if t is TierKind.DRAM][:2]
        lease = s.lease_n([CHAIN[a], OTHER[0], CHAIN[b]], ttl_s=60)
        assert lease is not None and lease.lease_id and lease.hits[1] is None
        dram = s.tier(TierKind.DRAM)
        for i, h in ((a, lease.hits[0]), (b, lease.hits[2])):
            assert h[0] is TierKind.DRAM and torch.equal(torch.from_numpy(dram.slot_view(h[1])), data[i])
        st = s.stats()
        assert st.tier(TierKind.DRAM).counters.hits == after.tier(TierKind.DRAM).counters.hits + 2
        assert st.misses == after.misses + 1 and st.open_leases == 1
        s.put_n(OTHER[1:5], blocks(4, seed=7))  # pressure: leased blocks stay put
        assert torch.equal(torch.from_numpy(dram.slot_view(lease.hits[0][1])), data[a])
        s.release(lease.lease_id)
        assert s.stats().open_leases == 0
        assert s.lease_n([OTHER[9]]).lease_id == 0  # only misses: nothing to lease


def test_a_deferred_block_found_corrupted_is_dropped_and_a_miss_not_a_hit(tmp_path):
    with make(tmp_path, dram=0, ssd=6) as s:
        data = blocks(4, seed=5)
        s.put_n(CHAIN[:4], data)  # block i in slot i of a fresh SSD tier
        tier = s.tier(TierKind.SSD)
        path, offset = tier.locate(CHAIN[3])
        with open(path, "r+b") as f:
            f.seek(offset + 7)
            f.write(b"\xff\x00")
        rows = torch.zeros(1, NS.block_bytes, dtype=torch.uint8)
        lease = s.fetch_n(CHAIN[:4], rows, lease_tier=None, max_copied=1)
        misses = s.stats().misses
        assert s.stats().tier(TierKind.SSD).counters.hits == 4
        window = torch.zeros(3, NS.block_bytes, dtype=torch.uint8)
        assert s.read_deferred(lease.lease_id, CHAIN[1:4], window) == [True, True, False]
        st = s.stats()
        assert st.tier(TierKind.SSD).counters.hits == 3 and st.misses == misses + 1
        assert st.tier(TierKind.SSD).counters.corrupt == 1
        assert s.contains_n(CHAIN[:4]) == [True, True, True, False]
        s.release(lease.lease_id)
        assert s.remove_n(CHAIN[:3]) == 3, "a reader count was left held"


def test_a_batch_naming_a_block_twice_is_read_twice_and_holds_nothing_after(tmp_path):
    """A GET may name a block twice: streamed, each copy is copied or deferred on its own
    (both read, both in order), every hold goes back; found corrupted at both places, it is
    removed once (its slot freed twice would go to two blocks)."""
    from kvstore.reads import DEFERRED, NO_SLOT
    with make(tmp_path, dram=0, ssd=6) as s:
        data = blocks(3, seed=8)
        s.put_n(CHAIN[:3], data)
        names = [CHAIN[0], CHAIN[1], CHAIN[2], CHAIN[0]]
        rows = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
        lease = s.fetch_n(names, rows, lease_tier=None, max_copied=2)
        assert [h[1] for h in lease.hits] == [NO_SLOT, NO_SLOT, DEFERRED, DEFERRED]
        window = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
        assert s.read_deferred(lease.lease_id, names[2:], window) == [True, True]
        assert torch.equal(window[0], data[2]) and torch.equal(window[1], data[0])
        s.release(lease.lease_id)
        assert s.remove_n(CHAIN[:3]) == 3, "a reader count was left held"

        s.put_n(CHAIN[:3], data)
        free = s.tier(TierKind.SSD).num_free()
        path, offset = s.tier(TierKind.SSD).locate(CHAIN[0])
        with open(path, "r+b") as f:
            f.seek(offset + 3)
            f.write(b"\x5a\xa5")
        out = torch.zeros(4, NS.block_bytes, dtype=torch.uint8)
        assert s.get_n(names, out) == [None, TierKind.SSD, TierKind.SSD, None]
        assert s.tier(TierKind.SSD).num_free() == free + 1
        assert s.stats().tier(TierKind.SSD).counters.corrupt == 1
        s.put_n(CHAIN[3:5], blocks(2, seed=9))  # two fresh blocks, two distinct slots
        got = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
        assert s.get_n(CHAIN[3:5], got) == [TierKind.SSD] * 2
        assert s.remove_n(CHAIN[1:5]) == 4


def test_a_windowed_fetch_says_which_row_each_copied_block_is_in(tmp_path):
    """With max_copied the k-th block copied goes to row k, a corrupted one included (a
    miss, its row spent): `lease.rows` names each hit's row, so no block after a corrupted
    one is answered with its neighbour's bytes."""
    from kvstore.reads import DEFERRED
    with make(tmp_path, dram=0, ssd=8) as s:
        data = blocks(5, seed=11)
        s.put_n(CHAIN[:5], data)
        path, offset = s.tier(TierKind.SSD).locate(CHAIN[1])
        with open(path, "r+b") as f:
            f.seek(offset + 9)
            f.write(b"\x0f\xf0")
        rows = torch.zeros(3, NS.block_bytes, dtype=torch.uint8)
        lease = s.fetch_n(CHAIN[:5], rows, lease_tier=None, max_copied=3)
        assert [h is None for h in lease.hits] == [False, True, False, False, False]
        assert lease.rows == (0, -1, 2, -1, -1)
        assert [h[1] for h in lease.hits if h is not None][2:] == [DEFERRED, DEFERRED]
        assert torch.equal(rows[0], data[0]) and torch.equal(rows[2], data[2])
        s.release(lease.lease_id)
        assert s.remove_n(CHAIN[:5]) == 4, "a reader count was left held"


@pytest.mark.parametrize("kind", [TierKind.DRAM, TierKind.SSD], ids=["dram", "ssd"])
def test_a_put_of_a_block_another_put_has_reserved_stores_it_too(tmp_path, kind):
    """A hash reserved by a put still in flight was answered EXISTS to every other put of
    it: when that first put then failed (a disk that refused its write, a client gone
    midway, a same-host writer timed out), the block was stored by no one, and the put
    told EXISTS had stored nothing. Now each stores it; the first to commit keeps it, the
    other's slot goes back (same hash, same bytes), and an abort loses nothing."""
    data = blocks(3)
    sizes = {"dram": 8} if kind is TierKind.DRAM else {"dram": 0, "ssd": 8}
    for order in ("abort", "first commits", "second commits", "both abort"):
        with make(tmp_path / order.replace(" ", "-"), **sizes) as s:
            first = s.reserve_n(CHAIN[:2])
            s.write_reserved(first, data[:2])
            second = s.reserve_n(CHAIN[1:3])  # CHAIN[1] reserved by the first, not stored
            assert second.statuses == (PutStatus.STORED,) * 2
            assert s.stats().tier(kind).used_blocks == 4
            s.write_reserved(second, data[1:3])
            assert s.contains_n(CHAIN[:3]) == [False] * 3
            if order == "abort":
                s.abort(first.reservation_id)
                s.commit(second.reservation_id)
                assert s.contains_n(CHAIN[:3]) == [False, True, True]
            elif order == "first commits":
                s.commit(first.reservation_id)
                assert s.put_n(CHAIN[1:2], data[1:2]) == [PutStatus.EXISTS]
                s.commit(second.reservation_id)  # its CHAIN[1] is a twin: the slot back
                assert s.contains_n(CHAIN[:3]) == [True] * 3
            elif order == "second commits":
                s.commit(second.reservation_id)
                s.commit(first.reservation_id)
                assert s.contains_n(CHAIN[:3]) == [True] * 3
            else:
                s.abort(second.reservation_id)
                s.abort(first.reservation_id)
                assert s.contains_n(CHAIN[:3]) == [False] * 3
                assert s.stats().tier(kind).used_blocks == 0
                continue
            stored = s.contains_n(CHAIN[:3]).count(True)
            assert s.stats().tier(kind).used_blocks == stored  # no slot kept twice
            tiers, out = read(s, CHAIN[:3])
            for i in range(3):
                if tiers[i] is not None:
                    assert torch.equal(out[i], data[i])
            said = [h for ev in s.drain_events() if ev.kind is EventKind.STORED
                    for h in ev.block_hashes]
            assert said.count(CHAIN[1]) == 1  # stored once, whoever won
            if kind is TierKind.SSD:  # and so it is on disk: the index and the headers
                s.close()
                with make(tmp_path / order.replace(" ", "-"), **sizes) as again:
                    tiers, out = read(again, CHAIN[:3])
                    assert [t is not None for t in tiers] == [order != "abort", True, True]
                    assert torch.equal(out[1:], data[1:])
                    assert again.stats().tier(kind).used_blocks == stored
                    assert again.tier(TierKind.SSD).num_recovered_from_slabs == 0
                continue
            s.remove_n(CHAIN[:3])
            assert s.stats().tier(kind).used_blocks == 0  # nothing leaked


def test_a_put_whose_twin_failed_on_the_disk_is_stored(tmp_path, monkeypatch):
    """The report that found it: put A's write to the SSD tier is refused (ENOSPC, as a
    copy-on-write filesystem gives on a full disk) while put B of the same block runs: A is
    NO_SPACE, and B, told EXISTS before, had stored nothing. B must be stored and read."""
    import errno
    with make(tmp_path, dram=0, ssd=8, background_interval_s=None) as s:
        slabs = s.tier(TierKind.SSD).slabs
        writing, go = threading.Event(), threading.Event()
        real = os.pwritev

        def refusing(fd, bufs, offset):
            if fd == slabs.fd and threading.current_thread().name == "A":
                writing.set()
                go.wait(10)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, bufs, offset)
        monkeypatch.setattr(os, "pwritev", refusing)
        monkeypatch.setattr(slabfile, "NATIVE", False)  # (payloads through os.pwritev)
        got = {}
        a = threading.Thread(target=lambda: got.update(A=s.put_n(CHAIN[:1], blocks(1))),
                             name="A")
        a.start()
        assert writing.wait(10)
        got["B"] = s.put_n(CHAIN[:1], blocks(1))
        go.set()
        a.join(10)
        assert got == {"A": [PutStatus.NO_SPACE], "B": [PutStatus.STORED]}
        tiers, out = read(s, CHAIN[:1])
        assert tiers == [TierKind.SSD] and torch.equal(out[0], blocks(1)[0])


def test_a_block_named_twice_in_a_put_the_disk_refuses_is_no_space_both_times(tmp_path,
                                                                            monkeypatch):
    """The second naming of a block in one batch is EXISTS (the first stores it); when the
    disk then refused the write, the first became NO_SPACE and the second stayed EXISTS:
    told stored, nothing was."""
    import errno
    with make(tmp_path, dram=0, ssd=8, background_interval_s=None) as s:
        slabs = s.tier(TierKind.SSD).slabs
        real = os.pwritev

        def refusing(fd, bufs, offset):
            if fd == slabs.fd:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, bufs, offset)
        monkeypatch.setattr(os, "pwritev", refusing)
        monkeypatch.setattr(slabfile, "NATIVE", False)  # (payloads through os.pwritev)
        got = s.put_n([CHAIN[0], CHAIN[1], CHAIN[0]], blocks(3))
        assert got == [PutStatus.NO_SPACE] * 3 and s.contains_n(CHAIN[:2]) == [False] * 2
        monkeypatch.setattr(os, "pwritev", real)
        assert s.put_n([CHAIN[0], CHAIN[0]], blocks(2)) == [PutStatus.STORED, PutStatus.EXISTS]
