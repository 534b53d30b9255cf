"""Each policy on hand-made clusters where the right choice is obvious."""
import dataclasses

import pytest

from kvstore.events import EventKind, KVEvent, TierKind
from kvstore.index import ClusterIndex
from kvstore.scheduler import (ClusterView, DecodeLoad, PolicyKind, PrefillLoad,
                               RejectReason, RouteRequest, SchedulerConfig, make_policy)
from kvstore.scheduler.cost_model import DecodeCost

BLOCK = 512


def hashes(n, start=0):
    return tuple(i.to_bytes(16, "little") for i in range(start, start + n))


def request(blocks=20, output=100):
    return RouteRequest(1, 0.0, blocks * BLOCK, output, hashes(blocks))


def cluster(held: dict[str, int], queues: dict[str, float], decode=None, extra_nodes=()):
    """Prefill nodes `queues`; node n holds the first held[n] blocks of `request()`."""
    index = ClusterIndex()
    for node in list(queues) + list(extra_nodes):
        index.add_node(node)
    for node, n in held.items():
        index.apply(KVEvent(EventKind.STORED, node, 0, TierKind.DRAM, hashes(n)))
    decode = decode or (DecodeLoad("d0", 4, 40_000, 1_000_000),)
    prefill = tuple(PrefillLoad(n, q) for n, q in queues.items())
    return ClusterView(prefill, decode, index)


def test_registry_builds_each_kind():
    for kind in PolicyKind:
        assert make_policy(kind).kind is kind
    with pytest.raises(TypeError):
        make_policy("conductor")


def test_round_robin_cycles():
    policy = make_policy(PolicyKind.ROUND_ROBIN)
    view = cluster({}, {"a": 0, "b": 0, "c": 0})
    assert [policy.place(request(), view).prefill_node for _ in range(4)] == list("abca")


def test_random_is_seeded_and_covers_nodes():
    view = cluster({}, {f"p{i}": 0 for i in range(4)})
    picks = [make_policy(PolicyKind.RANDOM, seed=3).place(request(), view) for _ in range(2)]
    assert picks[0] == picks[1]
    policy = make_policy(PolicyKind.RANDOM, seed=3)
    assert {policy.place(request(), view).prefill_node for _ in range(200)} == set(
        f"p{i}" for i in range(4))


def test_least_loaded_ignores_cache():
    view = cluster({"busy": 20}, {"busy": 5.0, "idle": 0.1})
    assert make_policy(PolicyKind.LEAST_LOADED).place(request(), view).prefill_node == "idle"


def test_prefix_prefers_longest_local_hit_at_equal_load():
    view = cluster({"a": 5, "b": 15, "c": 0}, {"a": 1.0, "b": 1.0, "c": 1.0})
    placement = make_policy(PolicyKind.PREFIX).place(request(), view)
    assert (placement.prefill_node, placement.cached_blocks) == ("b", 15)
    assert placement.fetch_node is None


def test_prefix_leaves_a_hit_behind_a_long_queue():
    view = cluster({"a": 15}, {"a": 60.0, "b": 0.0})
    assert make_policy(PolicyKind.PREFIX).place(request(), view).prefill_node == "b"


def test_conductor_fetches_hot_prefix_to_idle_node():
    # "a" holds 18 of 20 blocks but is busy: fetching them to idle "b" beats both waiting
    # on "a" and recomputing on "b" (a 160 MiB block moves in ~2 ms, computes in ~60 ms).
    view = cluster({"a": 18, "b": 2}, {"a": 30.0, "b": 0.0})
    placement = make_policy(PolicyKind.CONDUCTOR).place(request(), view)
    assert placement.prefill_node == "b"
    assert (placement.cached_blocks, placement.fetch_node, placement.fetch_blocks) == (2, "a", 16)
    assert placement.estimated_ttft_s < 30.0


def test_conductor_stays_local_when_holder_is_free():
    view = cluster({"a": 18}, {"a": 0.0, "b": 0.0})
    placement = make_policy(PolicyKind.CONDUCTOR).place(request(), view)
    assert (placement.prefill_node, placement.fetch_blocks) == ("a", 0)


def test_conductor_fetches_from_pool_node():
    view = cluster({"pool": 20}, {"a": 0.0, "b": 0.0}, extra_nodes=["pool"])
    placement = make_policy(PolicyKind.CONDUCTOR).place(request(), view)
    assert placement.fetch_node == "pool" and placement.fetch_blocks == 20


def test_conductor_fetches_only_from_listed_sources():
    # "a" holds 18 blocks but only the pool can hand blocks over (serving workers' own
    # caches are not sources): busy "a" or recompute on "b", never a fetch from "a"
    view = cluster({"a": 18, "pool": 12}, {"a": 30.0, "b": 0.0}, extra_nodes=["pool"])
    view = ClusterView(view.prefill, view.decode, view.index, sources=frozenset({"pool"}))
    placement = make_policy(PolicyKind.CONDUCTOR).place(request(), view)
    assert (placement.prefill_node, placement.fetch_node, placement.fetch_blocks) == ("b", "pool", 12)
    no_pool = ClusterView(view.prefill, view.decode, view.index, sources=frozenset())
    assert make_policy(PolicyKind.CONDUCTOR).place(request(), no_pool).fetch_blocks == 0


def test_conductor_respects_balancing_threshold():
    # local 10, remote 12: 1.2x < 2.0 threshold, so no fetch even though it would help
    view = cluster({"a": 12, "b": 10}, {"a": 50.0, "b": 0.0})
    config = SchedulerConfig(balancing_threshold=2.0)
    placement = make_policy(PolicyKind.CONDUCTOR, config).place(request(), view)
    assert (placement.prefill_node, placement.fetch_blocks) == ("b", 0)


def test_decode_choice_by_load_and_capacity():
    decode = (DecodeLoad("full", 1, 995_000, 1_000_000), DecodeLoad("heavy", 90, 800_000,
              1_000_000), DecodeLoad("light", 3, 30_000, 1_000_000))
    view = cluster({}, {"a": 0.0}, decode=decode)
    for kind in (PolicyKind.LEAST_LOADED, PolicyKind.PREFIX, PolicyKind.CONDUCTOR):
        assert make_policy(kind).place(request(), view).decode_node == "light"


def test_decode_choice_under_a_flat_cost_model_goes_to_the_less_loaded():
    """A decode cost fitted flat (a constant step: what noisy timings can give) makes every
    estimate equal; the request goes to the instance with fewer sequences, not the first by
    name."""
    base = SchedulerConfig().cost
    flat = dataclasses.replace(base, decode=DecodeCost(0.01, 0.0, 0.0))
    decode = (DecodeLoad("d0", 1, 500, 1_000_000), DecodeLoad("d1", 0, 0, 1_000_000))
    view = cluster({}, {"a": 0.0}, decode=decode)
    for kind in (PolicyKind.LEAST_LOADED, PolicyKind.PREFIX, PolicyKind.CONDUCTOR):
        policy = make_policy(kind, SchedulerConfig(cost=flat))
        assert policy.place(request(), view).decode_node == "d1"


def test_early_rejection_on_slo():
    config = SchedulerConfig(ttft_slo_s=5.0, tbt_slo_s=0.1, early_reject=True)
    policy = make_policy(PolicyKind.CONDUCTOR, config)
    busy = cluster({}, {"a": 100.0})
    assert policy.place(request(), busy).reject is RejectReason.TTFT_SLO
    slow_decode = cluster({}, {"a": 0.0}, decode=(DecodeLoad("d", 500, 3_000_000, 10**8),))
    assert policy.place(request(), slow_decode).reject is RejectReason.TBT_SLO
    assert policy.place(request(), cluster({}, {"a": 0.0})).reject is None


def test_empty_cluster_is_rejected():
    view = ClusterView((), (DecodeLoad("d", 0, 0, 1),), ClusterIndex())
    for kind in PolicyKind:
        assert make_policy(kind).place(request(), view).reject is RejectReason.NO_INSTANCE
