"""Demo workloads: multi-turn conversations in Mooncake's trace format, turned into token
prompts.

A row is one request of Mooncake's conversation trace (`hash_ids`: each id names one trace
block and everything before it, so two requests share exactly the blocks their id lists
share), plus optional `conversation` / `turn` fields saying which conversation it belongs
to (inferred from shared prefixes when absent). Each trace block becomes
`trace_block_tokens` token ids drawn from a generator seeded by its id, so shared trace
blocks are shared token blocks (and shared KV blocks) here too; id 0, the prefix of every
request in the trace, plays the shared system prompt. A few unique tokens end each prompt
(the user's newest words), so no prompt is entirely cached.

Two workloads ship as package data (`kvtier/data/`), both derived from
`../shared/data/traces/conversation_trace.jsonl` by `python -m kvtier.derive`:
- `long` (the default): long-context conversations, 1-3k tokens growing turn by turn, some
  sharing a document prefix, 64 tokens per trace block;
- `short`: the first demo's 157-token prompts (16 tokens per trace block).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash

from kvstore.scheduler.trace import load_trace

TOKEN_RANGE = (1000, 30000)   # ordinary vocabulary ids of SmolLM2 (no special tokens)
TAIL_TOKENS = 5               # each prompt's own last words, unique to the request


class WorkloadSpec(NamedTuple):
    file: str                 # under kvtier/data/
    trace_block_tokens: int   # token ids per trace block
    output_divisor: int       # max_tokens = trace output_length // this, clipped
    max_tokens: tuple[int, int]


WORKLOADS = {
    "long": WorkloadSpec("long.jsonl", 64, 64, (4, 8)),
    "short": WorkloadSpec("short.jsonl", 16, 64, (4, 12)),
}


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    conversation: int         # requests of one conversation are sent one after another
    turn: int


def workload_path(name: str) -> str:
    """The packaged file of workload `name` (the one place that knows where they live)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", WORKLOADS[name].file)


def load(name_or_path: str, limit: int | None = None,
         spec: WorkloadSpec | None = None) -> list[WorkloadRequest]:
    """Requests of a packaged workload (`long`, `short`) or a Mooncake-format JSONL file
    (read with the `short` workload's token mapping unless `spec` says otherwise)."""
    if name_or_path in WORKLOADS:
        spec, path = WORKLOADS[name_or_path], workload_path(name_or_path)
    else:
        spec, path = spec or WORKLOADS["short"], name_or_path
        load_trace(path, limit)  # every line checked (TraceFormatError names a bad one)
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[:limit] if limit is not None else rows
    for i, r in enumerate(rows):
        _check_turn(i + 1, r)
    if any("conversation" not in r for r in rows):
        rows = annotate_conversations(rows)
    return [_request(i, r, spec) for i, r in enumerate(rows)]


def _check_turn(line: int, row: dict) -> None:
    """A row's `conversation` and `turn`: both or neither, each an integer >= 0 (a row with
    a conversation and no turn had ended the demo in a KeyError)."""
    from kvstore.scheduler.trace import TraceFormatError
    given = [k for k in ("conversation", "turn") if k in row]
    if not given:
        return
    if len(given) == 1:
        raise TraceFormatError(f"line {line}: '{given[0]}' without "
                               f"'{({'conversation', 'turn'} - set(given)).pop()}': give both "
                               "or neither (the conversations are then found from hash_ids)")
    for k in given:
        v = row[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TraceFormatError(f"line {line}: '{k}' must be an integer >= 0, not {v!r}")


def _request(i: int, row: dict, spec: WorkloadSpec) -> WorkloadRequest:
    bt = spec.trace_block_tokens
    ids = [t for h in row["hash_ids"] for t in block_tokens(h, bt)]
    ids += block_tokens(10**9 + i, TAIL_TOKENS)
    max_tokens = int(np.clip(row["output_length"] // spec.output_divisor, *spec.max_tokens))
    return WorkloadRequest(i, tuple(ids), max_tokens, int(row["conversation"]), int(row["turn"]))


def block_tokens(block_id: int, n: int) -> list[int]:
    """The `n` token ids standing for trace block `block_id` (the same in every process)."""
    return np.random.default_rng(block_id).integers(*TOKEN_RANGE, n).tolist()


def follow_ups(rows: list[dict]) -> dict[int, int]:
    """request index -> the earlier request it continues: a follow-up turn repeats all of
    its parent's trace blocks but the last (the parent's partial block gets completed)."""
    owner: dict[tuple, int] = {}   # every prefix of every request so far -> latest request
    parent_of: dict[int, int] = {}
    for i, r in enumerate(rows):
        h = tuple(r["hash_ids"])
        for n in range(len(h), 1, -1):
            j = owner.get(h[:n])
            if j is not None and n >= len(rows[j]["hash_ids"]) - 1:
                parent_of[i] = j
                break
        for n in range(1, len(h) + 1):
            owner[h[:n]] = i
    return parent_of


def annotate_conversations(rows: list[dict]) -> list[dict]:
    """Rows with `conversation` (the index of its first turn) and `turn` filled in."""
    parent_of, out = follow_ups(rows), []
    for i, r in enumerate(rows):
        root, turn = i, 0
        while root in parent_of:
            root, turn = parent_of[root], turn + 1
        out.append({**r, "conversation": root, "turn": turn})
    return out


def hit_ratio_bound(workload: list[WorkloadRequest], block_tokens: int = 16) -> float:
    """Prefix hit ratio of an infinite cache: the leading blocks of each prompt seen in an
    earlier prompt, over all prompt tokens. (Order does not matter as long as each turn
    comes after the ones it continues: a block misses exactly once, on first sight.)"""
    seen: set[bytes] = set()
    hit = 0
    for r in workload:
        ids = np.asarray(r.prompt_token_ids, dtype=np.int32)
        usable = (len(ids) - 1) // block_tokens  # the engine computes at least one token
        key, first_miss = b"", None
        for i in range(len(ids) // block_tokens):  # a chained key: a block and all before it
            block = ids[i * block_tokens:(i + 1) * block_tokens]
            key = xxhash.xxh3_128_digest(key + block.tobytes())
            if first_miss is None and key not in seen:
                first_miss = i
            seen.add(key)
        held = len(ids) // block_tokens if first_miss is None else first_miss
        hit += block_tokens * min(usable, held)
    return hit / max(1, sum(len(r.prompt_token_ids) for r in workload))
