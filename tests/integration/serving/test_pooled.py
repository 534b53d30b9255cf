"""`kvtier cluster --colocated 2 --pool`: colocated workers sharing a store node, and the
router's block index fed by the KV events of both workers and the store node. A small
paged cache and a small pool, so that evictions happen within a few requests."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from .cluster_proc import SYSTEM, Cluster, sse_events

POOL_BLOCKS = 64  # --dram-size below holds about this many SmolLM2 blocks (737,280 bytes)


@pytest.fixture(scope="module")
def pooled():
    c = Cluster("--colocated", "2", "--pool", "--num-blocks", "64", "--dram-size", "45MiB")
    try:
        yield c.wait_ready()
    finally:
        c.stop()


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 30000, n).tolist()


def complete(cluster, prompt, max_tokens=1) -> dict:
    status, msg = cluster.post_json("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0, "ignore_eos": True})
    assert status == 200, msg
    return msg


def located(cluster, prompt) -> dict[str, int]:
    status, msg = cluster.post_json("/cluster/locate", {"prompt": prompt})
    assert status == 200, msg
    return msg["nodes"]


def wait_for(cluster, prompt, ok, what: str, timeout_s: float = 30.0) -> dict[str, int]:
    """Poll the router's index until `ok(nodes)`; events arrive every ~50 ms."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = located(cluster, prompt)
        if ok(nodes):
            return nodes
        time.sleep(0.1)
    pytest.fail(f"the router's index never showed {what}: {nodes}")


def test_a_prefix_one_worker_computed_is_a_pool_hit_on_the_other(pooled):
    _, events = sse_events(pooled.url, "/v1/completions",
                           {"prompt": SYSTEM + " First question: what is a KV cache?",
                            "max_tokens": 1, "temperature": 0})
    list(events)
    wait_for(pooled, SYSTEM, lambda n: n.get("pool", 0) >= 10, "the SYSTEM blocks in the pool")
    # a long decode on the worker that holds the prefix: both workers are idle and the
    # prompt shares nothing, so the tie goes to the same (first) worker again
    long = {"prompt": "Count slowly:", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    busy_headers, busy_events = sse_events(pooled.url, "/v1/completions", long)
    next(busy_events)
    owner = busy_headers["X-Kvtier-Prefill-Worker"]
    assert located(pooled, SYSTEM).get(owner, 0) >= 10, "the long decode went to the other worker"
    headers, events = sse_events(pooled.url, "/v1/completions",
                                 {"prompt": SYSTEM + " Second question: why share it?",
                                  "max_tokens": 1, "temperature": 0,
                                  "stream_options": {"include_usage": True}})
    usage = [json.loads(m)["usage"] for m in events if m.startswith("{") and '"usage"' in m]
    list(busy_events)
    assert headers["X-Kvtier-Prefill-Worker"] != owner  # the owner was busy decoding
    assert usage[-1]["prompt_tokens_details"]["cached_tokens"] >= 160  # from the pool


def test_the_router_index_drops_blocks_evicted_from_a_worker_and_from_the_pool(pooled):
    prompt = tokens(1, 20 * 16 + 3)
    complete(pooled, prompt)
    nodes = wait_for(pooled, prompt, lambda n: n.get("pool", 0) == 20 and len(n) == 2,
                     "the prompt's 20 blocks on its worker and in the pool")
    worker = next(n for n in nodes if n != "pool")
    for seed in range(2, 9):  # 7 x 20 new blocks: more than each cache and the pool hold
        complete(pooled, tokens(seed, 20 * 16 + 3))
    wait_for(pooled, prompt, lambda n: n.get(worker, 0) < 20 and n.get("pool", 0) < 20,
             "the prompt's blocks gone from its worker and from the pool")
    # the index matches the caches: the prompt is (mostly) computed again
    usage = complete(pooled, prompt)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] < 20 * 16
