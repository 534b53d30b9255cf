"""Prefix offload through a real TieredStore: DRAM hits, SSD hits in a fresh engine after a
reopen, corrupt or missing blocks, a failing store, a full save queue."""
import threading

import pytest

from engine_adapter.config import EngineConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.sampling import SamplingParams
from kvstore.config import StoreConfig, TierConfig
from kvstore.events import TierKind
from kvstore.store import TieredStore
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
    assert out.num_loaded_tokens == 12 and engine.connector.stats.load_misses == 6
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
