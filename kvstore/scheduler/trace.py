"""Mooncake-format traces: one JSON object per line with `timestamp` (ms), `input_length`,
`output_length` and `hash_ids`, each id naming one block of the prompt chained on all
before it. Ids become 16-byte keys so the index sees the same key type as live."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

from kvstore.scheduler.base import RouteRequest


class TraceFormatError(ValueError):
    """A trace line is not a Mooncake-format request."""


def block_key(block_id: int) -> bytes:
    """The 16-byte key the simulator uses for a trace block id."""
    return block_id.to_bytes(16, "little")


MAX_SPAN_S = 1e9  # a trace's arrivals, from its first: past ~30 years a simulator's float
# clock no longer moves by a decode step (a timestamp of 1e20 ms never finished)


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[RouteRequest]:
    """Requests from a Mooncake-format JSONL trace, in file order (first `limit` only).
    Every field is checked for what it is, never coerced: TraceFormatError names the line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f):
            if limit is not None and line_no >= limit:
                return
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("a line is one JSON object")
                yield RouteRequest(
                    request_id=line_no,
                    arrival_s=_number(rec, "timestamp") / 1000.0,
                    input_tokens=_integer(rec, "input_length"),
                    output_tokens=_integer(rec, "output_length"),
                    block_hashes=tuple(block_key(_block_id(i)) for i in _list(rec, "hash_ids")),
                )
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                raise TraceFormatError(f"{path}:{line_no + 1}: {exc}") from exc


def _number(rec: dict, key: str) -> float:
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, not {v!r}")
    return float(v)


def _integer(rec: dict, key: str) -> int:
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, int):  # (1.7 and "12" were taken as 1, 12)
        raise ValueError(f"{key} must be an integer, not {v!r}")
    return v


def _list(rec: dict, key: str) -> list:
    v = rec[key]
    if not isinstance(v, list):  # (a string "123" was taken as ids 1, 2, 3)
        raise ValueError(f"{key} must be a list of block ids, not {v!r}")
    return v


def _block_id(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 128:
        raise ValueError(f"a block id must be an integer in [0, 2**128), not {v!r}")
    return v


def load_trace(path: str | Path, limit: int | None = None) -> list[RouteRequest]:
    """All requests of a trace sorted by arrival (stable, so file order breaks ties), their
    times counted from the first arrival (a trace in epoch milliseconds reads as one from
    0). TraceFormatError for a trace with no request, or arrivals spread over more than
    MAX_SPAN_S."""
    requests = sorted(iter_trace(path, limit), key=lambda r: r.arrival_s)
    if not requests:
        raise TraceFormatError(f"{path}: the trace holds no requests")
    first = requests[0].arrival_s
    span = requests[-1].arrival_s - first
    if span > MAX_SPAN_S:
        raise TraceFormatError(f"{path}: arrivals span {span:.3g} s (at most {MAX_SPAN_S:.0e}): "
                               "timestamps are milliseconds")
    return [dataclasses.replace(r, arrival_s=r.arrival_s - first) for r in requests]


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
