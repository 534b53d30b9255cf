"""Mooncake-format traces: one JSON object per line with `timestamp` (ms), `input_length`,
`output_length` and `hash_ids`, each id naming one block of the prompt chained on all
before it. Ids become 16-byte keys so the index sees the same key type as live."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from kvstore.scheduler.base import RouteRequest


class TraceFormatError(ValueError):
    """A trace line is not a Mooncake-format request."""


def block_key(block_id: int) -> bytes:
    """The 16-byte key the simulator uses for a trace block id."""
    return block_id.to_bytes(16, "little")


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[RouteRequest]:
    """Requests from a Mooncake-format JSONL trace, in file order (first `limit` only)."""
    with open(path) as f:
        for line_no, line in enumerate(f):
            if limit is not None and line_no >= limit:
                return
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                yield RouteRequest(
                    request_id=line_no,
                    arrival_s=float(rec["timestamp"]) / 1000.0,
                    input_tokens=int(rec["input_length"]),
                    output_tokens=int(rec["output_length"]),
                    block_hashes=tuple(block_key(int(i)) for i in rec["hash_ids"]),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{path}:{line_no + 1}: {exc}") from exc


def load_trace(path: str | Path, limit: int | None = None) -> list[RouteRequest]:
    """All requests of a trace sorted by arrival (stable, so file order breaks ties)."""
    return sorted(iter_trace(path, limit), key=lambda r: r.arrival_s)


def infinite_cache_hit_ratio(requests: list[RouteRequest]) -> float:
    """Block hit ratio with one unbounded cache shared by all: the bound for any policy.

    A block hits when it is in the leading run of blocks seen in earlier requests."""
    seen: set = set()
    hits = total = 0
    for req in requests:
        n = 0
        for key in req.block_hashes:
            if key not in seen:
                break
            n += 1
        hits += n
        total += len(req.block_hashes)
        seen.update(req.block_hashes)
    return hits / total if total else 0.0
