"""`kvtier cluster --colocated 1`: the baseline path (one worker does prefill and decode, no
pool) behind the same front end."""
from __future__ import annotations

import json

import pytest

from .cluster_proc import SYSTEM, Cluster, sse_events


@pytest.fixture(scope="module")
def colocated():
    c = Cluster("--colocated", "1", "--num-blocks", "128")
    try:
        yield c.wait_ready()
    finally:
        c.stop()


def test_colocated_serves_without_a_store(colocated):
    view = colocated.get_json("/cluster")
    assert not view["pooled"] and [w["role"] for w in view["workers"]] == ["colocated"]
    assert "kvtier serve" not in colocated.output()


def test_colocated_stream_reuses_the_workers_own_cache(colocated):
    body = {"prompt": SYSTEM + " First question?", "max_tokens": 3, "temperature": 0}
    status, first = colocated.post_json("/v1/completions", body)
    assert status == 200 and first["usage"]["completion_tokens"] == 3
    _, events = sse_events(colocated.url, "/v1/completions",
                           {**body, "prompt": SYSTEM + " Second question?",
                            "stream_options": {"include_usage": True}})
    msgs = [json.loads(d) for d in events if d != "[DONE]"]
    usage = msgs[-1]["usage"]
    assert usage["completion_tokens"] == 3
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 160  # the shared SYSTEM blocks
