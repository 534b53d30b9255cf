"""Shared output for every benchmark in bench/: one JSON object and one printed table.

Format (DESIGN.md): {"bench": NAME, "machine": {...}, "results": [row, ...]} where a row is
{"case", "metric", "value", "baseline", "baseline_value", "ratio"}; ratio = value / baseline
for rates, baseline / value for times and sizes (so higher is always better), None without
baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from typing import NamedTuple

TIME_METRICS = {"s", "ms", "us", "ns"}
LOWER_IS_BETTER = TIME_METRICS | {"bytes"}  # ratio = baseline / value


class Row(NamedTuple):
    case: str
    metric: str
    value: float
    baseline: str | None = None
    baseline_value: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline_value is None or not self.value or not self.baseline_value:
            return None
        if self.metric in LOWER_IS_BETTER:
            return self.baseline_value / self.value
        return self.value / self.baseline_value

    def as_dict(self) -> dict:
        return {**self._asdict(), "ratio": self.ratio}


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def median_rows(rounds: list[list[Row]]) -> list[Row]:
    """One row per (case, metric, baseline) of several rounds of the same rows, in the
    first round's order: the median of its values and, apart, of its baseline's values (a
    row some round lacks, e.g. a peer that failed once, takes the median of the others)."""
    groups: dict[tuple, list[Row]] = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault((r.case, r.metric, r.baseline), []).append(r)
    out = []
    for (case, metric, baseline), rs in groups.items():
        bases = [r.baseline_value for r in rs if r.baseline_value is not None]
        out.append(Row(case, metric, statistics.median(r.value for r in rs), baseline,
                       statistics.median(bases) if bases else None))
    return out


def report(bench: str, rows: list[Row], json_path: str | None) -> None:
    """Print the rows as a table and, when asked, write them as JSON."""
    header = ("case", "metric", "value", "baseline", "base value", "ratio")
    table = [header] + [
        (r.case, r.metric, _fmt(r.value), r.baseline or "-", _fmt(r.baseline_value), _fmt(r.ratio))
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for n, line in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    if json_path:
        doc = {"bench": bench, "machine": machine_info(), "results": [r.as_dict() for r in rows]}
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {json_path}", file=sys.stderr)
