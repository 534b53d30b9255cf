"""How the packaged demo workloads were picked from Mooncake's conversation trace.

    python -m kvtier.derive long ../shared/data/traces/conversation_trace.jsonl \
        kvtier/data/long.jsonl
    python -m kvtier.derive short ../shared/data/traces/conversation_trace.jsonl \
        kvtier/data/short.jsonl

`long`: conversations (chains of requests, each turn repeating the one before and adding
to it) whose first turns all fall in 1-2.5k tokens at 64 tokens per trace block: first the
groups of conversations that share a document prefix (several leading trace blocks past
the system prompt), then five-turn conversations in trace order. `short`: the first demo's
sample (10 three-turn conversations of at most 20 blocks and 8 one-off requests).
"""
from __future__ import annotations

import json
import sys

from kvtier.workload import WORKLOADS, annotate_conversations, follow_ups


def chains_of(rows: list[dict]) -> dict[int, list[int]]:
    """first request -> every request of its conversation, in order."""
    parent_of, chains = follow_ups(rows), {}
    for i in range(len(rows)):
        root = i
        while root in parent_of:
            root = parent_of[root]
        chains.setdefault(root, []).append(i)
    return chains


def _shared(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def derive_long(rows: list[dict], num_conversations: int = 6, turns: int = 6,
                min_tokens: int = 1000, max_tokens: int = 2000, doc_groups: int = 2,
                min_doc_blocks: int = 4) -> list[dict]:
    """`doc_groups` groups of conversations sharing a document (2 to `turns` turns each),
    then `turns`-turn conversations up to `num_conversations`, all in [min_tokens,
    max_tokens]."""
    bt = WORKLOADS["long"].trace_block_tokens
    fits = [t for t in (_turns_in(rows, c[:turns], min_tokens / bt, max_tokens / bt)
                        for c in chains_of(rows).values()) if len(t) >= 2]
    picked: list[list[int]] = []
    for c in fits:  # document groups: conversations sharing a prefix past the system prompt
        mates = [d for d in fits if d is not c and _shared(rows[c[0]]["hash_ids"],
                                                          rows[d[0]]["hash_ids"]) >= min_doc_blocks]
        group = [d for d in [c, *mates] if d not in picked]
        if mates and len(group) > 1 and doc_groups > 0:
            picked += group
            doc_groups -= 1
    rest = [c for c in fits if c not in picked and len(c) == turns]
    picked += rest[:num_conversations - len(picked)]
    picked.sort(key=lambda c: c[0])  # trace order of the first turns
    return [{**rows[i], "conversation": k, "turn": t}
            for k, c in enumerate(picked) for t, i in enumerate(c)]


def _turns_in(rows: list[dict], chain: list[int], lo_blocks: float, hi_blocks: float) -> list[int]:
    """The leading turns of `chain` within the block range, each longer than the last
    (a turn no longer than the one before it is a retry, not a reply)."""
    out: list[int] = []
    for i in chain:
        n = len(rows[i]["hash_ids"])
        if not lo_blocks <= n <= hi_blocks or (out and n <= len(rows[out[-1]]["hash_ids"])):
            break
        out.append(i)
    return out


def derive_short(rows: list[dict], num_conversations: int = 10, turns: int = 3,
                 max_blocks: int = 20, num_single: int = 8) -> list[dict]:
    """The first demo's sample, in trace order."""
    chains = sorted((c for c in chains_of(rows).values() if len(c) > 1), key=lambda c: c[1])
    picked = [c[:turns] for c in chains
              if len(c) >= turns and len(rows[c[turns - 1]]["hash_ids"]) <= max_blocks
              and len({len(rows[i]["hash_ids"]) for i in c[:turns]}) == turns]  # no retries
    in_chain = {i for c in chains for i in c}
    single = [i for i, r in enumerate(rows)
              if i not in in_chain and 2 < len(r["hash_ids"]) <= max_blocks]
    keep = sorted([i for c in picked[:num_conversations] for i in c] + single[:num_single])
    return annotate_conversations([rows[i] for i in keep])


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("long", "short"):
        print(__doc__, file=sys.stderr)
        return 2
    kind, trace, out = argv
    with open(trace) as f:
        rows = [json.loads(line) for line in f]
    sample = derive_long(rows) if kind == "long" else derive_short(rows)
    with open(out, "w") as f:
        for row in sample:
            f.write(json.dumps(row) + "\n")
    print(f"{len(sample)} requests written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
