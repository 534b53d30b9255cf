"""Simulator invariants on a 300-request sample of Mooncake's conversation trace."""
from pathlib import Path

import pytest

from kvstore.events import TierKind
from kvstore.index import ClusterIndex
from kvstore.scheduler import PolicyKind, SchedulerConfig, make_policy
from kvstore.scheduler.cost_model import DecodeCost
from kvstore.scheduler.sim_instances import BlockCache, DecodeInstance
from kvstore.scheduler.sim_report import summarize
from kvstore.scheduler.simulator import SimConfig, Simulator, simulate
from kvstore.scheduler.trace import (TraceFormatError, block_key, infinite_cache_hit_ratio,
                                     load_trace)

SAMPLE = Path(__file__).parents[2] / "data" / "conversation_trace_sample.jsonl"


@pytest.fixture(scope="module")
def requests():
    return load_trace(SAMPLE)


def small_cluster(**kw):
    # Few instances and small caches so queues, evictions and fetches all happen.
    base = dict(num_prefill=3, num_decode=2, prefill_cache_blocks=300,
                decode_capacity_tokens=200_000, speedup=4.0)
    base.update(kw)
    return SimConfig(**base)


@pytest.mark.parametrize("kind", list(PolicyKind))
def test_every_request_finishes_once_in_time_order(requests, kind):
    config = small_cluster()
    outcomes = simulate(requests, make_policy(kind, config.scheduler), config)
    assert [o.request_id for o in outcomes] == [r.request_id for r in requests]
    for o in outcomes:
        assert o.reject is None
        assert o.arrival_s <= o.prefill_start_s <= o.first_token_s <= o.finish_s
        assert 0 <= o.hit_blocks <= o.total_blocks
    bound = infinite_cache_hit_ratio(requests)
    summary = summarize(outcomes, 30.0, 0.1)
    assert 0 < summary.hit_ratio <= bound + 1e-12
    assert summary.num_finished == len(requests)


def test_unbounded_single_instance_reaches_the_bound(requests):
    config = small_cluster(num_prefill=1, prefill_cache_blocks=10**7)
    outcomes = simulate(requests, make_policy(PolicyKind.PREFIX, config.scheduler), config)
    hit = summarize(outcomes, 30.0, 0.1).hit_ratio
    assert hit == pytest.approx(infinite_cache_hit_ratio(requests))


def test_conductor_fetches_and_replicates(requests):
    config = small_cluster()
    sim = Simulator(config, make_policy(PolicyKind.CONDUCTOR, config.scheduler))
    outcomes = sim.run(requests)
    assert sum(o.fetched_blocks for o in outcomes) > 0
    # the index matches every simulated cache: it was fed only by their events
    for node, cache in sim.caches.items():
        assert len(sim.index.blocks_of(node, TierKind.DRAM)) == len(cache)


def test_pool_node_is_a_fetch_source(requests):
    config = small_cluster(prefill_cache_blocks=50, pool_blocks=10**6)
    outcomes = simulate(requests, make_policy(PolicyKind.CONDUCTOR, config.scheduler), config)
    pooled = summarize(outcomes, 30.0, 0.1).hit_ratio
    config = small_cluster(prefill_cache_blocks=50)
    outcomes = simulate(requests, make_policy(PolicyKind.CONDUCTOR, config.scheduler), config)
    assert pooled > summarize(outcomes, 30.0, 0.1).hit_ratio


def test_early_rejection_accounts_each_request_once(requests):
    sched = SchedulerConfig(ttft_slo_s=1.0, early_reject=True)
    config = small_cluster(num_prefill=1, speedup=20.0, scheduler=sched)
    outcomes = simulate(requests, make_policy(PolicyKind.CONDUCTOR, sched), config)
    summary = summarize(outcomes, sched.ttft_slo_s, sched.tbt_slo_s)
    assert summary.num_rejected > 0
    assert summary.num_rejected + summary.num_finished == len(requests)
    assert len({o.request_id for o in outcomes}) == len(requests)


def test_decode_virtual_clock_by_hand():
    decode = DecodeInstance("d", 1000, DecodeCost(base_s=0.01, per_seq_s=0.01, per_kv_token_s=0))
    decode.arrive(1, 100, 10, now_s=0.0)  # alone: 0.02 s per step
    assert decode.next_finish_s() == pytest.approx(0.2)
    decode.arrive(2, 100, 2, now_s=0.1)  # 5 steps done; now 0.03 s per step
    assert decode.next_finish_s() == pytest.approx(0.16)
    assert decode.pop_finished(0.16) == [2]
    # request 1: 5 + 2 steps done, 3 left alone at 0.02 s
    assert decode.next_finish_s() == pytest.approx(0.22)
    assert decode.pop_finished(0.22) == [1]


def test_decode_waits_for_kv_room():
    decode = DecodeInstance("d", 150, DecodeCost(0.01, 0.0, 0.0))
    decode.arrive(1, 100, 1, now_s=0.0)
    decode.arrive(2, 100, 1, now_s=0.0)  # does not fit beside 1
    assert decode.pop_finished(0.01) == [1]
    assert decode.next_finish_s() == pytest.approx(0.02)


def test_block_cache_evicts_tail_first_and_publishes():
    index = ClusterIndex()
    cache = BlockCache("n", 4, index)
    keys = [block_key(i) for i in range(6)]
    cache.insert(keys[:4], 0.0)
    cache.insert(keys[4:6], 1.0)  # two chain tails of the first prefix go
    assert cache.prefix(keys) == 2
    assert index.query(keys).length("n") == 2
    assert index.blocks_of("n", TierKind.DRAM) == set(keys[:2] + keys[4:])


def test_bad_trace_line_is_reported(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(TraceFormatError, match="bad.jsonl:1"):
        load_trace(path)
