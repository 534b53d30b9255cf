"""The packaged demo workloads: what they hold, how prompts are built, the hit-ratio bound."""
import json

import pytest

from kvtier.replay import conversations
from kvtier.workload import (TAIL_TOKENS, WORKLOADS, WorkloadSpec,
                                             annotate_conversations, hit_ratio_bound, load,
                                             workload_path)


def test_long_workload_is_multi_turn_long_context_and_shares_prefixes():
    w = load("long")
    lengths = [len(r.prompt_token_ids) for r in w]
    assert 1000 <= min(lengths) and max(lengths) <= 3000
    convs = conversations(w)
    assert len(convs) >= 6 and max(len(c) for c in convs) >= 5
    for c in convs:  # each turn repeats the one before it, beyond the turn's own last words
        for prev, nxt in zip(c, c[1:]):
            keep = len(prev.prompt_token_ids) - TAIL_TOKENS - WORKLOADS["long"].trace_block_tokens
            assert nxt.prompt_token_ids[:keep] == prev.prompt_token_ids[:keep]
    firsts = [c[0].prompt_token_ids for c in convs]
    system = WORKLOADS["long"].trace_block_tokens
    assert len({f[:system] for f in firsts}) == 1  # one system prompt for all
    docs = [(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1:]
            if a[:4 * system] == b[:4 * system]]
    assert docs  # some conversations open on the same document
    assert 0.6 < hit_ratio_bound(w) < 0.9


def test_short_workload_is_the_first_demos_sample():
    with open(workload_path("short")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 38 and all("conversation" in r for r in rows)
    assert sum(len(r.prompt_token_ids) for r in load("short")) / 38 < 200


def test_a_file_without_conversations_gets_them_inferred(tmp_path):
    rows = [{"timestamp": 0, "input_length": 100, "output_length": 64, "hash_ids": [0, 1]},
            {"timestamp": 1, "input_length": 100, "output_length": 64, "hash_ids": [0, 2]},
            {"timestamp": 2, "input_length": 200, "output_length": 64, "hash_ids": [0, 1, 3, 4]}]
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = load(str(path), spec=WorkloadSpec("", 16, 64, (4, 8)))
    assert [(r.conversation, r.turn) for r in w] == [(0, 0), (1, 0), (0, 1)]
    inferred = annotate_conversations(rows)
    assert [(r["conversation"], r["turn"]) for r in inferred] == [(0, 0), (1, 0), (0, 1)]


def test_bound_counts_each_block_once_and_leaves_a_token_to_compute():
    from kvtier.workload import WorkloadRequest
    a = tuple(range(1000, 1064))                      # 4 blocks of 16
    reqs = [WorkloadRequest(0, a, 4, 0, 0), WorkloadRequest(1, a + (5,), 4, 0, 1),
            WorkloadRequest(2, a, 4, 1, 0)]
    # 2nd: all 4 blocks seen; 3rd: the same 64 tokens, but the last one must be computed
    assert hit_ratio_bound(reqs) == pytest.approx((64 + 48) / (64 + 65 + 64))


@pytest.mark.parametrize("extra,says", [({"conversation": 0}, "without 'turn'"),
                                        ({"turn": 1}, "without 'conversation'"),
                                        ({"conversation": "a", "turn": 0}, "integer"),
                                        ({"conversation": 0, "turn": True}, "integer"),
                                        ({"conversation": -1, "turn": 0}, "integer")])
def test_a_rows_conversation_and_turn_are_both_given_and_whole_numbers(tmp_path, extra, says):
    """A row with a conversation and no turn ended the demo in a KeyError; "a" was an
    error naming no line."""
    from kvstore.scheduler.trace import TraceFormatError
    row = {"timestamp": 0, "input_length": 32, "output_length": 10, "hash_ids": [0, 1]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, **extra}) + "\n")
    with pytest.raises(TraceFormatError, match=f"line 2: .*{says}"):
        load(str(path))
