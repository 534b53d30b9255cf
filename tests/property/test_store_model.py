"""TieredStore against a dict model, with the store's invariants checked after every step.

The model knows each block's bytes (content-addressed) and follows the store's KV events to
know which blocks are present; every answer of the store is checked against it.
"""
import collections
import shutil
import tempfile

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.config import StoreConfig, TierConfig
from kvstore.events import EventKind
from kvstore.keys import Namespace, hash_blocks
from kvstore.events import TierKind
from kvstore.store import NO_SLOT, PutStatus, TieredStore

NS = Namespace("prop", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=2)
POOL = hash_blocks(NS, list(range(2 * 24)))
CONTENT = {h: np.random.default_rng(i).integers(0, 256, NS.block_bytes, dtype=np.uint8)
           for i, h in enumerate(POOL)}
MAX_PINNED = 4
keys = st.lists(st.sampled_from(POOL), min_size=1, max_size=6)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvtier-prop-")
        self.config = StoreConfig((TierConfig("gpu", 3, device="cpu"), TierConfig("dram", 3),
                                   TierConfig("ssd", 12, path=self.dir)))
        self.store = TieredStore(NS, self.config)
        self.present: set[bytes] = set()
        self.pins = collections.Counter()
        self.next_seq = 0

    def teardown(self):
        self.store.close(flush=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _follow_events(self):
        for e in self.store.drain_events():
            assert e.seq == self.next_seq, "KV events must be numbered without gaps"
            self.next_seq += 1
            for h in e.block_hashes:
                (self.present.add if e.kind is EventKind.STORED else self.present.discard)(h)
        for h in list(self.pins):
            if h not in self.present:
                raise AssertionError("a pinned block left the store")

    @rule(hashes=keys)
    def put(self, hashes):
        before = set(self.present)
        statuses = self.store.put_n(hashes, [CONTENT[h] for h in hashes])
        first = {}
        for h, status in zip(hashes, statuses):
            if h in first or h in before:
                assert status is not PutStatus.STORED
            if status is PutStatus.NO_SPACE:
                st_ = self.store.stats()
                assert all(t.free_blocks == 0 for t in st_.tiers)
                assert len(self.pins) == MAX_PINNED or sum(self.pins.values()) > 0
            first.setdefault(h, status)
        self._follow_events()
        for h, status in first.items():
            if status is PutStatus.STORED:
                assert h in self.present or h not in before  # it may already have been demoted out

    @rule(hashes=keys)
    def get(self, hashes):
        before = set(self.present)
        out = torch.zeros(len(hashes), NS.block_bytes, dtype=torch.uint8)
        tiers = self.store.get_n(hashes, out)
        for h, tier, row in zip(hashes, tiers, out):
            assert (tier is not None) == (h in before), "a hit must be exactly a present block"
            if tier is not None:
                assert np.array_equal(row.numpy(), CONTENT[h]), "wrong bytes for a block"
        self._follow_events()

    @rule(hashes=keys)
    def get_prefix(self, hashes):
        before = set(self.present)
        out = torch.zeros(len(hashes), NS.block_bytes, dtype=torch.uint8)
        m = self.store.get_prefix_n(hashes, out)
        n = 0
        while n < len(hashes) and hashes[n] in before:
            n += 1
        assert m.num_blocks == n and len(m.tiers) == n
        for h, row in zip(hashes[:n], out[:n]):
            assert np.array_equal(row.numpy(), CONTENT[h]), "wrong bytes in the prefix"
        self._follow_events()

    @rule(hashes=keys, prefix=st.booleans())
    def fetch(self, hashes, prefix):
        """Leased DRAM slots and copied rows both hold the right bytes; one visit each."""
        before = set(self.present)
        rows = torch.zeros(len(hashes), NS.block_bytes, dtype=torch.uint8)
        lease = self.store.fetch_n(hashes, rows, prefix=prefix)
        arena = self.store.tier(TierKind.DRAM).arena
        try:
            stop = False
            for h, hit, copied, row in zip(hashes, lease.hits, lease.copied, rows):
                stop = stop or (prefix and h not in before)
                assert (hit is not None) == (h in before and not stop)
                if hit is None:
                    continue
                assert hit[1] != NO_SLOT or copied, "a hit neither leased nor copied"
                if hit[1] != NO_SLOT:
                    assert np.array_equal(arena[hit[1]], CONTENT[h])
                if copied:
                    assert np.array_equal(row.numpy(), CONTENT[h])
        finally:
            self.store.release(lease.lease_id)
        self._follow_events()

    @rule(hashes=keys, prefix=st.booleans(), evict_meanwhile=st.booleans())
    def hold(self, hashes, prefix, evict_meanwhile):
        """Held DRAM slots keep their bytes while held (even against an eviction); a batch
        with a block in another tier is refused whole, with nothing counted or held."""
        before = set(self.present)
        hits0 = self.store.stats().hits
        misses0 = self.store.stats().misses
        got = self.store.hold_n(hashes, TierKind.DRAM, prefix)
        dram = self.store._p.tiers.index(self.store.tier(TierKind.DRAM))
        if got is None:
            in_order = hashes[:next((i for i, h in enumerate(hashes) if prefix and h not in before),
                                    len(hashes))]
            assert any(h in before and self.store._p.entries[h].tier != dram for h in in_order)
            assert self.store.stats().hits == hits0
            assert self.store.stats().misses == misses0
            return
        kinds, held = got
        arena = self.store.tier(TierKind.DRAM).arena
        try:
            if evict_meanwhile:
                self.store.evict_n(hashes)
            stop, n_hits, n_misses = False, 0, 0
            for h, kind in zip(hashes, kinds):
                if stop:
                    assert kind is None
                    continue
                assert (kind is TierKind.DRAM) == (h in before)
                n_hits += kind is not None
                n_misses += kind is None
                stop = prefix and kind is None
            assert [e.hash for e in held] == [h for h, k in zip(hashes, kinds) if k is not None]
            for e in held:
                assert np.array_equal(arena[e.slot], CONTENT[e.hash])
            assert self.store.stats().hits == hits0 + n_hits
            assert self.store.stats().misses == misses0 + n_misses
        finally:
            self.store.unhold_n(held)
        self._follow_events()

    @rule(hashes=keys)
    def match(self, hashes):
        m = self.store.match_prefix(hashes)
        n = 0
        while n < len(hashes) and hashes[n] in self.present:
            n += 1
        assert m.num_blocks == n

    @precondition(lambda self: len(self.pins) < MAX_PINNED)
    @rule(h=st.sampled_from(POOL))
    def pin(self, h):
        if self.store.pin_n([h]) == [True]:
            self.pins[h] += 1
        else:
            assert h not in self.present

    @precondition(lambda self: len(self.pins) > 0)
    @rule(data=st.data())
    def unpin(self, data):
        h = data.draw(st.sampled_from(sorted(self.pins)))
        self.store.unpin_n([h])
        self.pins[h] -= 1
        if self.pins[h] == 0:
            del self.pins[h]

    @rule(hashes=keys)
    def evict(self, hashes):
        self.store.evict_n(hashes)
        self._follow_events()

    @rule(hashes=keys)
    def remove(self, hashes):
        gone = self.store.remove_n(hashes)
        assert gone == len({h for h in hashes if h in self.present})  # no reader holds any
        for h in hashes:
            self.pins.pop(h, None)
        self._follow_events()
        assert not any(h in self.present for h in hashes)

    @rule()
    def maintain(self):
        self.store.maintain()
        self._follow_events()

    @rule()
    def reopen(self):
        in_memory = {e.hash for e in self.store._p.entries.values() if e.tier < 2}
        must_survive = in_memory | set(self.pins)
        before = set(self.present)
        self.store.close(flush=True)
        self.store = TieredStore(NS, self.config)
        self.present, self.pins, self.next_seq = set(), collections.Counter(), 0
        self._follow_events()
        assert must_survive <= self.present <= before

    @invariant()
    def no_reader_is_left_holding_a_block(self):
        assert all(e.readers == 0 for e in self.store._p.entries.values())

    @invariant()
    def slots_are_accounted(self):
        p = self.store._p
        per_tier = collections.defaultdict(set)
        for e in p.entries.values():
            assert (e.tier, e.slot) not in {(e.tier, s) for s in per_tier[e.tier]}
            per_tier[e.tier].add(e.slot)
        for i, tier in enumerate(p.tiers):
            assert tier.num_free() + len(per_tier[i]) == tier.num_slots
            for h in p.lru[i]:
                assert p.entries[h].tier == i
        assert set(p.entries) == self.present
        assert self.store.contains_n(POOL) == [h in self.present for h in POOL]


StoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestStoreModel = StoreMachine.TestCase


class DramOnlyMachine(StoreMachine):
    """One tier, so a put makes room by dropping: a single block's put takes the store's
    short path (`TieredStore._reserve_one`) into a full tier."""

    def __init__(self):
        super().__init__()
        self.store.close(flush=False)
        self.config = StoreConfig((TierConfig("dram", 4),))
        self.store = TieredStore(NS, self.config)

    @rule(hashes=st.lists(st.sampled_from(POOL), min_size=1, max_size=3))
    def put(self, hashes):  # (a batch bigger than the tier is NO_SPACE in part, pins or not)
        super().put(hashes)

    @precondition(lambda self: False)
    @rule()
    def reopen(self):  # nothing of a memory tier outlives its store
        pass


DramOnlyMachine.TestCase.settings = StoreMachine.TestCase.settings
TestDramOnlyStoreModel = DramOnlyMachine.TestCase
