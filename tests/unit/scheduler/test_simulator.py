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


@pytest.mark.parametrize("line,why", [
    ('{"timestamp": 1e400, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "finite"),
    ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "finite"),
    ('{"timestamp": 0, "input_length": 1.7, "output_length": 1, "hash_ids": [1]}', "integer"),
    ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [1]}', "integer"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "123"}', "list"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}', "2\\*\\*128"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1e3]}', "2\\*\\*128"),
    ('[1, 2]', "one JSON object"),
])
def test_a_trace_line_is_checked_for_what_each_field_is_never_coerced(tmp_path, line, why):
    """Values were coerced (1.7 -> 1, true -> 1, "123" -> ids 1, 2, 3), a block id of -1
    raised a bare OverflowError, and a timestamp of NaN or infinity crashed or hung the
    simulator; each is now a TraceFormatError naming the line."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                    + line + "\n")
    with pytest.raises(TraceFormatError, match=f"t.jsonl:2: .*{why}"):
        load_trace(path)


def test_traces_that_cannot_be_simulated_are_refused_and_times_start_at_the_first(tmp_path):
    """An empty trace crashed the report (ZeroDivisionError), a non-UTF-8 one raised a bare
    UnicodeDecodeError, and arrivals 1e20 ms apart never finished (a decode step no longer
    moved the float clock); a trace in epoch milliseconds simulates as one from 0."""
    ok = '{"timestamp": %s, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
    cases = {"empty.jsonl": b"\n", "latin1.jsonl": b'{"timestamp": "\xe9"}\n',
             "far.jsonl": (ok % 0 + ok % "1e20").encode()}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TraceFormatError, match=name):
            load_trace(tmp_path / name)
    (tmp_path / "epoch.jsonl").write_text(ok % 1.8e12 + ok % (1.8e12 + 500))
    assert [r.arrival_s for r in load_trace(tmp_path / "epoch.jsonl")] == [0.0, 0.5]


@pytest.mark.parametrize("bad", [dict(speedup=float("nan")), dict(speedup=1e-300),
                                 dict(speedup=float("inf"))])
def test_a_speedup_that_stops_the_clock_is_refused(bad):
    with pytest.raises(ValueError, match="speedup"):
        SimConfig(**bad)


def test_an_slo_that_no_request_can_meet_is_refused():
    from kvstore.scheduler.base import SchedulerConfig
    for slo in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="SLOs"):
            SchedulerConfig(ttft_slo_s=slo)
