"""The demo workload: multi-turn conversations behind one shared system prompt, derived from
Mooncake's conversation trace (`hash_ids`: each id names a 512-token block and everything
before it, so two requests share exactly the blocks their id lists share).

Each trace block becomes `block_tokens` token ids drawn from a generator seeded by its id,
so shared trace blocks are shared token blocks (and shared KV blocks) here too; id 0, the
prefix of every request in the trace, plays the shared system prompt. The tail of a prompt
past its last full block is unique to the request.

    python -m engine_adapter.serving.workload ../shared/data/traces/conversation_trace.jsonl \
        tests/data/demo_workload.jsonl        # how the committed sample was derived
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np

TOKEN_RANGE = (1000, 30000)   # ordinary vocabulary ids of SmolLM2 (no special tokens)


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def _block_tokens(block_id: int, n: int) -> list[int]:
    rng = np.random.default_rng(block_id)
    return rng.integers(*TOKEN_RANGE, n).tolist()


def load(path: str, block_tokens: int = 16, tail_tokens: int = 5,
         limit: int | None = None) -> list[WorkloadRequest]:
    """Requests of a Mooncake-format JSONL file, in file order, as token prompts."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            ids = [t for h in row["hash_ids"] for t in _block_tokens(h, block_tokens)]
            ids += _block_tokens(10**9 + i, tail_tokens)  # the request's own last words
            max_tokens = int(np.clip(row["output_length"] // 64, 4, 12))
            out.append(WorkloadRequest(i, tuple(ids), max_tokens))
    return out


def derive(trace_path: str, num_conversations: int = 10, turns: int = 3, max_blocks: int = 20,
           num_single: int = 8) -> list[dict]:
    """Pick conversations (chains of requests, each extending an earlier one's blocks) of
    `turns` turns with at most `max_blocks` blocks, plus `num_single` one-turn requests that
    share only the system prompt; keep them in trace order."""
    rows = [json.loads(line) for line in open(trace_path)]
    owner: dict[tuple, int] = {}   # every prefix of every request so far -> latest request
    parent_of: dict[int, int] = {}
    for i, r in enumerate(rows):
        h = tuple(r["hash_ids"])
        for n in range(len(h), 1, -1):  # a follow-up shares its parent's full blocks
            j = owner.get(h[:n])
            if j is not None and n >= len(rows[j]["hash_ids"]) - 1:
                parent_of[i] = j
                break
        for n in range(1, len(h) + 1):
            owner[h[:n]] = i
    chains: dict[int, list[int]] = {}
    for i in sorted(parent_of):
        root = i
        while root in parent_of:
            root = parent_of[root]
        chains.setdefault(root, [root]).append(i)
    picked = [c[:turns] for c in chains.values()
              if len(c) >= turns and len(rows[c[turns - 1]]["hash_ids"]) <= max_blocks
              and len({len(rows[i]["hash_ids"]) for i in c[:turns]}) == turns]  # no retries
    in_chain = {i for c in chains.values() for i in c}
    single = [i for i, r in enumerate(rows)
              if i not in in_chain and 2 < len(r["hash_ids"]) <= max_blocks]
    keep = sorted([i for c in picked[:num_conversations] for i in c] + single[:num_single])
    return [rows[i] for i in keep]


if __name__ == "__main__":
    sample = derive(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        for row in sample:
            f.write(json.dumps(row) + "\n")
    print(f"{len(sample)} requests written to {sys.argv[2]}")
