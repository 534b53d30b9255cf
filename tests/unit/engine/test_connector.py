"""Prefix offload through a real TieredStore: DRAM hits, SSD hits in a fresh engine after a
reopen, corrupt or missing blocks, a failing store, a full save queue."""
import threading

import pytest

from engine_adapter.config import EngineConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.sampling import SamplingParams
from kvstore.config import StoreConfig, TierConfig
from kvstore.events import TierKind
from kvstore.store import PutStatus, TieredStore
from kvstore.testing import flip_ssd_byte

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CFG = EngineConfig(num_blocks=64, block_tokens=4, max_num_batched_tokens=64)


def open_store(ns, path=None, dram=64):
    tiers = [TierConfig("dram", dram)] + ([TierConfig("ssd", 256, path=str(path))] if path else [])
    return TieredStore(ns, StoreConfig(tiers=tuple(tiers)))


def run(model, prompt, store=None, config=CFG):
    engine = LLMEngine(model, config, store=store, record_logits=True)
    out = engine.generate([prompt], GREEDY)[0]
    engine.close()
    return out, engine.logits[out.request_id], engine


def assert_same(a, b):
    (out_a, logits_a), (out_b, logits_b) = a, b
    assert out_a.token_ids == out_b.token_ids
    for x, y in zip(logits_a, logits_b):
        assert (x - y).abs().max() < 1e-4


def test_dram_hit_in_another_engine_computes_only_the_suffix(tiny_model, prompts):
    base, base_logits, e = run(tiny_model, prompts[2])
    with open_store(e.ns) as store:
        run(tiny_model, prompts[2], store)  # saves the prompt's blocks
        out, logits, _ = run(tiny_model, prompts[2], store)
        assert out.num_loaded_tokens == 36 and out.num_model_tokens == base.num_model_tokens - 36
    assert_same((out, logits), (base, base_logits))


def test_ssd_hit_after_reopen_in_a_fresh_engine(tiny_model, prompts, tmp_path):
    base, base_logits, e = run(tiny_model, prompts[2])
    with open_store(e.ns, tmp_path) as store:
        run(tiny_model, prompts[2], store)
    with open_store(e.ns, tmp_path) as store:  # a restart: the blocks are on SSD now
        hashes = e.add_request(prompts[2], GREEDY).block_hashes
        assert store.match_prefix(hashes).tiers == (TierKind.SSD,) * 10
        out, logits, _ = run(tiny_model, prompts[2], store)
    assert out.num_loaded_tokens == 36
    assert_same((out, logits), (base, base_logits))


def test_a_corrupt_block_ends_the_loaded_prefix_and_the_rest_is_recomputed(tiny_model, prompts, tmp_path):
    base, base_logits, e = run(tiny_model, prompts[2])
    hashes = e.add_request(prompts[2], GREEDY).block_hashes
    with open_store(e.ns, tmp_path) as store:
        run(tiny_model, prompts[2], store)
    with open_store(e.ns, tmp_path) as store:
        flip_ssd_byte(store, hashes[3])
        out, logits, engine = run(tiny_model, prompts[2], store)
        ssd = next(t for t in store.stats().tiers if t.kind is TierKind.SSD)
        assert ssd.counters.corrupt == 1  # found by the read, which ended the prefix there
    assert out.num_loaded_tokens == 12 and engine.connector.stats.loaded_blocks == 3
    assert_same((out, logits), (base, base_logits))


def test_a_batch_of_mixed_hits_and_misses_matches_running_each_alone(tiny_model, prompts):
    expected = [run(tiny_model, p)[0].token_ids for p in prompts]
    ns = LLMEngine(tiny_model, CFG).ns
    with open_store(ns) as store:
        run(tiny_model, prompts[1], store)
        run(tiny_model, prompts[2][:21], store)  # a partial prefix of prompt 2
        engine = LLMEngine(tiny_model, CFG, store=store)
        outs = engine.generate(prompts, GREEDY)
        engine.close()
    assert [o.token_ids for o in outs] == expected
    assert [o.num_loaded_tokens for o in outs] == [0, 16, 20, 0]


class BrokenStore:
    def put_n(self, hashes, srcs):
        raise ConnectionError("store down")

    get_n = match_prefix = contains_n = put_n


def test_a_failing_store_degrades_to_recompute_and_counts_errors(tiny_model, prompts):
    base = run(tiny_model, prompts[2])[0]
    out, _, engine = run(tiny_model, prompts[2], BrokenStore())
    assert out.token_ids == base.token_ids and out.num_loaded_tokens == 0
    stats = engine.connector.stats
    assert stats.lookup_errors == 1 and stats.save_errors > 0 and stats.saved_blocks == 0


class SlowStore:
    """Blocks every put until released: the step loop must not wait for it."""

    def __init__(self):
        self.release, self.puts = threading.Event(), 0

    def put_n(self, hashes, srcs):
        self.release.wait(30)
        self.puts += 1
        return [PutStatus.STORED] * len(hashes)

    def get_n(self, hashes, dsts):
        return [None] * len(hashes)

    def match_prefix(self, hashes):
        return type("M", (), {"num_blocks": 0})()

    def contains_n(self, hashes):
        return [False] * len(hashes)


def test_saves_never_stall_the_loop_a_full_queue_drops_them(tiny_model, prompts):
    store = SlowStore()
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_tokens=4, save_queue_batches=1),
                       store=store)
    outs = engine.generate(prompts, GREEDY)  # finishes although no put has returned
    assert all(len(o.token_ids) == 8 for o in outs)
    assert engine.connector.stats.save_dropped_blocks > 0
    store.release.set()
    engine.close()
    assert store.puts >= 1 and engine.connector.stats.saved_blocks > 0


class CountingStore:
    """A real TieredStore, its reads counted by name."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if name in ("get_n", "get_prefix_n", "match_prefix", "contains_n"):
            def counted(*args, **kw):
                self.calls.append(name)
                return attr(*args, **kw)
            return counted
        return attr


def test_a_stored_prefix_is_looked_up_and_read_in_one_round_trip(tiny_model, prompts):
    base, base_logits, e = run(tiny_model, prompts[2])
    with open_store(e.ns) as store:
        run(tiny_model, prompts[2], store)
        counting = CountingStore(store)
        out, logits, engine = run(tiny_model, prompts[2], counting)
        assert counting.calls == ["get_prefix_n"]  # no MATCH before it
        assert out.num_loaded_tokens == 36 and engine.connector.stats.lookups == 1
        # a prompt the store holds a part of: the read ends at the first block it lacks
        counting.calls.clear()
        part, _, _ = run(tiny_model, prompts[2][:21] + prompts[3], counting)
        assert counting.calls == ["get_prefix_n"] and part.num_loaded_tokens == 20
    assert_same((out, logits), (base, base_logits))


def test_a_prefix_longer_than_a_chunk_is_read_in_a_second_trip_for_the_rest(tiny_model, prompts):
    """The first read takes the blocks a miss would take for the first chunk (4 here); when
    they all hit, one more read takes the rest of the prefix (5)."""
    cfg = EngineConfig(num_blocks=64, block_tokens=4, max_num_batched_tokens=16)
    base, base_logits, e = run(tiny_model, prompts[2], config=cfg)
    with open_store(e.ns) as store:
        run(tiny_model, prompts[2], store, cfg)
        counting = CountingStore(store)
        out, logits, engine = run(tiny_model, prompts[2], counting, cfg)
        assert counting.calls == ["get_prefix_n", "get_prefix_n"]
        assert out.num_loaded_tokens == 36 and engine.connector.stats.loaded_blocks == 9
    assert_same((out, logits), (base, base_logits))


def test_without_free_blocks_for_its_chunk_a_request_waits_and_keeps_what_it_loaded(
        tiny_model, prompts):
    """A cache with room for one request at a time: the second is not admitted while the
    first runs, whatever its read loaded stays in the paged cache, and both finish with
    the output they have alone."""
    cfg = EngineConfig(num_blocks=14, block_tokens=4, max_num_batched_tokens=16)
    firsts = [prompts[2], prompts[3][:9], prompts[3]]  # the store holds 2 blocks of the 3rd
    alone = [run(tiny_model, p, config=cfg)[0].token_ids for p in firsts]
    with open_store(LLMEngine(tiny_model, cfg).ns) as store:
        for p in firsts[:2]:
            run(tiny_model, p, store, cfg)
        for batch in ([firsts[0], firsts[2]], [firsts[2], firsts[0]]):
            engine = LLMEngine(tiny_model, cfg, store=store)
            outs = engine.generate(batch, GREEDY)
            engine.close()
            assert [o.token_ids for o in outs] == [alone[firsts.index(p)] for p in batch]
            assert all(o.num_loaded_tokens + o.num_local_hit_tokens > 0 for o in outs)


def test_a_save_of_block_ids_outside_the_cache_is_refused_and_a_full_store_is_no_save(
        tmp_path):
    """An id outside the cache was clipped into range: another block's KV stored under the
    hash. And blocks the store answered NO_SPACE for were counted saved."""
    import torch
    from engine_adapter.connector import StoreConnector
    from kvstore.keys import Namespace, hash_blocks
    ns = Namespace("conn", num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4)
    cache = torch.randn(4, 1, 2, 4, 1, 8, dtype=torch.float16)  # [blocks, L, 2, bt, H, D]
    with TieredStore(ns, StoreConfig((TierConfig(TierKind.DRAM, 2),))) as store:
        conn = StoreConnector(store, cache)
        hs = hash_blocks(ns, list(range(4 * 4)))
        for ids in ([7, 1], [-3, 0], [0]):
            with pytest.raises(ValueError, match="outside the cache|block ids"):
                conn.save(hs[:2], ids)
        assert store.contains_n(hs) == [False] * 4
        store.put_n(hs[2:4], torch.zeros(2, ns.block_bytes, dtype=torch.uint8))
        assert store.pin_n(hs[2:4]) == [True, True]  # a full store whose blocks cannot go
        conn.save(hs[:2], [0, 1])
        conn.flush()
        assert conn.stats.saved_blocks == 0 and conn.stats.save_refused_blocks == 2
        conn.close()
