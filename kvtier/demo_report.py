"""The demo's table, JSON and chart.

The first run is the baseline; every figure of the others comes with its ratio to it,
oriented so that > 1 is better (baseline / value for times, value / baseline otherwise).
JSON is the project's shared benchmark format (DESIGN.md): {"bench": "demo", "machine":
{...}, "results": [{"case", "metric", "value", "baseline", "baseline_value", "ratio"}]},
one row per figure per configuration (the baseline's own rows have baseline null).
"""
from __future__ import annotations

import json
import os
import platform
from typing import Callable, NamedTuple

from kvtier.replay import RunResult


class Figure(NamedTuple):
    label: str
    metric: str                        # unit; "s" marks a time (lower is better)
    value: Callable[[RunResult], float]


def figures(ttft_slo_s: float) -> list[Figure]:
    return [Figure("prefix hit ratio", "ratio", lambda r: r.hit_ratio),
            Figure("TTFT p50", "s", lambda r: r.pct("ttft_s", 0.5)),
            Figure("TTFT p90", "s", lambda r: r.pct("ttft_s", 0.9)),
            Figure("TPOT p50", "s", lambda r: r.pct("tpot_s", 0.5)),
            Figure("TPOT p90", "s", lambda r: r.pct("tpot_s", 0.9)),
            Figure("throughput", "req/s", lambda r: r.rps),
            Figure(f"goodput (TTFT <= {ttft_slo_s:g} s)", "req/s", lambda r: r.goodput(ttft_slo_s))]


def ratio(metric: str, value: float, base: float) -> float | None:
    if not value or not base or value != value or base != base:  # zero or NaN
        return None
    return base / value if metric == "s" else value / base


def rows(results: list[RunResult], bound: float, ttft_slo_s: float) -> list[dict]:
    base, out = results[0], []
    for f in figures(ttft_slo_s):
        b = f.value(base)
        out.append(_row(f"{f.label} {base.name}", f.metric, b, None, None, None))
        for r in results[1:]:
            v = f.value(r)
            out.append(_row(f"{f.label} {r.name}", f.metric, v, base.name, b,
                            ratio(f.metric, v, b)))
    out.append(_row("prefix hit ratio bound (infinite cache)", "ratio", bound, None, None, None))
    return out


def _row(case, metric, value, baseline, baseline_value, r) -> dict:
    return {"case": case, "metric": metric, "value": value, "baseline": baseline,
            "baseline_value": baseline_value, "ratio": r}


def report(results: list[RunResult], bound: float, ttft_slo_s: float,
           json_path: str | None) -> None:
    print(f"\n{'':30}" + "".join(f"{r.name:>31}" for r in results))
    for f in figures(ttft_slo_s):
        b = f.value(results[0])
        cells = [f"{_fmt(b):>31}"] + [
            f"{_fmt(f.value(r))} ({_vs(f.metric, f.value(r), b)})".rjust(31) for r in results[1:]]
        print(f"{f.label + ' (' + f.metric + ')':30}" + "".join(cells))
    print(f"(x = ratio to {results[0].name}, > 1 is better; the hit ratio an infinite cache "
          f"would reach on this workload: {bound:.3f})")
    print("machine load (1-min average, start-end of each run): " + ", ".join(
        f"{r.name[:3]} {r.load[0]:.1f}-{r.load[1]:.1f}" for r in results))
    if len(results) > 1:
        print(verdict(results, bound))
    if json_path:
        doc = {"bench": "demo", "machine": {**machine(), "load_per_run": {
            r.name: list(r.load) for r in results}}, "results": rows(results, bound, ttft_slo_s)}
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"figures written to {json_path}")


def verdict(results: list[RunResult], bound: float) -> str:
    """The pooled run with the best TTFT p50, against the baseline."""
    base = results[0]
    p50 = base.pct("ttft_s", 0.5)
    best = max(results[1:], key=lambda r: ratio("s", r.pct("ttft_s", 0.5), p50) or 0)
    r = lambda m, f: ratio(m, f(best), f(base)) or 0.0  # noqa: E731
    return (f"best pooled: {best.name}: TTFT p50 {r('s', lambda x: x.pct('ttft_s', 0.5)):.2f}x, "
            f"p90 {r('s', lambda x: x.pct('ttft_s', 0.9)):.2f}x, throughput "
            f"{r('req/s', lambda x: x.rps):.2f}x, hit ratio {best.hit_ratio:.3f} "
            f"(bound {bound:.3f})")


def _vs(metric: str, value: float, base: float) -> str:
    r = ratio(metric, value, base)
    if r is not None:
        return f"{r:.3g}x"
    return "baseline 0" if value and not base else "-"


def _fmt(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.3g}"


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def chart(results: list[RunResult], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r, style in zip(results, ("o-", "s-", "^-")):
        ax.plot([s.ttft_s if s.ok else float("nan") for s in r.samples], style, ms=3,
                label=f"{r.name} (p50 {r.pct('ttft_s', 0.5):.2f} s)")
    ax.set_xlabel("request (conversation by conversation, turn by turn)")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.set_title("kvtier demo: TTFT per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
