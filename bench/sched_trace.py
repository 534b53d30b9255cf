"""Replay Mooncake's conversation trace through the scheduler simulator, one run per policy.

Prints, per policy, mean TTFT against random (ratio = random / policy), the block hit ratio
against the infinite-cache bound, goodput, and the cluster index's query latency against a
naive per-node walk; then our numbers beside the Mooncake paper's. Writes a PNG: TTFT CDF
per policy and hit ratio vs per-instance cache capacity.

    python bench/sched_trace.py [--quick] [--json out.json] [--png chart.png]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path


from tqdm import tqdm

from kvtier.report import Row, add_common_args, report
from kvstore.events import EventKind, KVEvent, TierKind
from kvstore.index import ClusterIndex
from kvstore.scheduler import PolicyKind, SchedulerConfig, make_policy
from kvstore.scheduler.sim_report import SimSummary, summarize
from kvstore.scheduler.simulator import RequestOutcome, SimConfig, simulate
from kvstore.scheduler.trace import infinite_cache_hit_ratio, load_trace

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / ".." / "shared" / "data" / "traces" / "conversation_trace.jsonl"
POLICIES = (PolicyKind.RANDOM, PolicyKind.ROUND_ROBIN, PolicyKind.LEAST_LOADED,
            PolicyKind.PREFIX, PolicyKind.CONDUCTOR)
# Mooncake paper, mean TTFT on its conversation trace (seconds).
PAPER_TTFT = {PolicyKind.RANDOM: ("random", 19.65),
              PolicyKind.LEAST_LOADED: ("load-balancing", 5.27),
              PolicyKind.PREFIX: ("local cache-aware", 3.58),
              PolicyKind.CONDUCTOR: ("global cache-aware", 3.07)}
QUICK_REQUESTS = 2000


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                        help="Mooncake-format JSONL trace (default: the shared conversation trace)")
    parser.add_argument("--quick", action="store_true",
                        help=f"first {QUICK_REQUESTS} requests, fewer capacity points")
    parser.add_argument("--png", type=Path,
                        default=Path(tempfile.gettempdir()) / "sched_trace.png")
    parser.add_argument("--prefill", type=int, default=8, help="prefill instances")
    parser.add_argument("--decode", type=int, default=8, help="decode instances")
    parser.add_argument("--cache-blocks", type=int, default=4096,
                        help="LRU cache per prefill instance, 512-token blocks")
    parser.add_argument("--pool-blocks", type=int, default=0, help="shared pool node (0: none)")
    parser.add_argument("--speedup", type=float, default=1.0, help="replay speed factor")
    parser.add_argument("--ttft-slo", type=float, default=10.0, help="TTFT SLO, seconds")
    parser.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO, seconds")
    args = parser.parse_args()
    args.trace = args.trace.resolve()
    if not args.trace.is_file():
        parser.error(f"trace not found: {args.trace} (pass --trace PATH to a Mooncake-format "
                     "JSONL trace, e.g. conversation_trace.jsonl)")
    return args


def run_policy(kind, requests, config: SimConfig, seed: int, label: str):
    policy = make_policy(kind, config.scheduler, seed)
    with tqdm(total=len(requests), desc=label, leave=False, file=sys.stderr,
              mininterval=1.0) as bar:
        outcomes = simulate(requests, policy, config, progress=bar)
    return outcomes, summarize(outcomes, config.scheduler.ttft_slo_s,
                               config.scheduler.tbt_slo_s)


def index_latency_us(num_nodes: int = 64, num_blocks: int = 1000, reps: int = 300):
    """Median µs of one query where every node holds the whole prefix (the longest walk),
    for the index and for a naive walk over per-node sets."""
    index = ClusterIndex()
    keys = [i.to_bytes(16, "little") for i in range(num_blocks)]
    node_sets = []
    for n in range(num_nodes):
        held = keys[: num_blocks - n]  # lengths 1000, 999, ... so every node is distinct
        index.apply(KVEvent(EventKind.STORED, f"n{n}", 0, TierKind.DRAM, tuple(held)))
        node_sets.append(set(held))

    def naive():
        out = []
        for held in node_sets:
            k = 0
            while k < num_blocks and keys[k] in held:
                k += 1
            out.append(k)
        return out

    def median_us(fn):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2] * 1e6

    return median_us(lambda: index.query(keys)), median_us(naive)


def capacity_sweep(requests, base: SimConfig, capacities, seed: int):
    curves = {}
    for kind in (PolicyKind.LEAST_LOADED, PolicyKind.PREFIX, PolicyKind.CONDUCTOR):
        curves[kind] = []
        for cap in capacities:
            config = dataclasses.replace(base, prefill_cache_blocks=cap)
            _, summary = run_policy(kind, requests, config, seed, f"{kind.value} cap={cap}")
            curves[kind].append(summary.hit_ratio)
    return curves


def plot(path: Path, outcomes: dict, capacities, curves, bound: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, outs in outcomes.items():
        ttft = np.sort([o.ttft_s for o in outs if o.reject is None])
        left.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=kind.value)
    left.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    left.legend()
    for kind, hits in curves.items():
        right.plot(capacities, hits, marker="o", label=kind.value)
    right.axhline(bound, color="k", linestyle="--", label="infinite-cache bound")
    right.set(xscale="log", xlabel="cache per prefill instance (512-token blocks)",
              ylabel="block hit ratio", title="hit ratio vs capacity")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def describe(config: SimConfig, num_requests: int) -> str:
    cost = config.scheduler.cost
    return (
        f"{num_requests} requests, {config.num_prefill} prefill + {config.num_decode} decode "
        f"instances, {config.prefill_cache_blocks} blocks LRU per prefill instance "
        f"({config.prefill_cache_blocks * cost.block_bytes / 2**40:.2f} TiB), pool "
        f"{config.pool_blocks} blocks, decode KV {config.decode_capacity_tokens} tokens, "
        f"speedup {config.speedup}\n  cost model: {cost.prefill}\n  {cost.decode}\n"
        f"  transfer dram {cost.transfer.dram}, block {cost.block_bytes / 2**20:.0f} MiB\n"
        f"  SLO TTFT {config.scheduler.ttft_slo_s} s, TBT {config.scheduler.tbt_slo_s} s, "
        f"balancing_threshold {config.scheduler.balancing_threshold}"
    )


def paper_table(summaries: dict[PolicyKind, SimSummary]) -> None:
    print("\nmean TTFT, paper (Mooncake, conversation trace) vs ours (simulated):")
    print(f"  {'policy':<22}{'paper s':>9}{'ours s':>9}{'paper rnd/x':>13}{'ours rnd/x':>12}")
    paper_rnd = PAPER_TTFT[PolicyKind.RANDOM][1]
    ours_rnd = summaries[PolicyKind.RANDOM].ttft_mean_s
    for kind, (name, paper) in PAPER_TTFT.items():
        ours = summaries[kind].ttft_mean_s
        print(f"  {name:<22}{paper:>9.2f}{ours:>9.2f}{paper_rnd / paper:>13.2f}"
              f"{ours_rnd / ours:>12.2f}")


def build_rows(summaries, rejecting: SimSummary, bound: float, index_us: float,
               naive_us: float, sim_s: float, num_requests: int) -> list[Row]:
    rnd = summaries[PolicyKind.RANDOM]
    rows = []
    for kind, s in summaries.items():
        rows += [
            Row(f"{kind.value} TTFT mean", "s", s.ttft_mean_s, "random", rnd.ttft_mean_s),
            Row(f"{kind.value} TTFT p90", "s", s.ttft_p90_s, "random", rnd.ttft_p90_s),
            Row(f"{kind.value} block hit ratio", "fraction", s.hit_ratio,
                "infinite-cache bound", bound),
            Row(f"{kind.value} goodput", "req/s", s.goodput_rps, "random", rnd.goodput_rps),
        ]
    return rows + [
        Row("conductor+early-reject goodput", "req/s", rejecting.goodput_rps, "random",
            rnd.goodput_rps),
        Row("conductor+early-reject rejections", "requests", rejecting.num_rejected),
        Row("index query 1000 blocks x 64 nodes", "us", index_us, "naive per-node walk",
            naive_us),
        Row(f"simulate {len(summaries)} policies x {num_requests} requests", "s", sim_s),
    ]


def print_details(summaries, rejecting: SimSummary, bound: float) -> None:
    print(f"\n{'policy':<14}{'TTFT mean':>10}{'p50':>8}{'p90':>8}{'p99':>8}{'TBT p90':>9}"
          f"{'hit':>7}{'fetched':>9}{'goodput':>9}{'rejected':>9}")
    for name, s in [(k.value, v) for k, v in summaries.items()] + [("cond+reject", rejecting)]:
        print(f"{name:<14}{s.ttft_mean_s:>10.2f}{s.ttft_p50_s:>8.2f}{s.ttft_p90_s:>8.2f}"
              f"{s.ttft_p99_s:>8.2f}{s.tbt_p90_s:>9.3f}{s.hit_ratio:>7.3f}"
              f"{s.fetched_ratio:>9.3f}{s.goodput_rps:>9.2f}{s.num_rejected:>9d}")
    print(f"infinite-cache bound hit ratio {bound:.3f}")
    paper_table(summaries)


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    try:  # (a bad trace or option: one line saying which, not a traceback)
        requests = load_trace(args.trace, QUICK_REQUESTS if args.quick else None)
        sched = SchedulerConfig(ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo)
        config = SimConfig(num_prefill=args.prefill, num_decode=args.decode,
                           prefill_cache_blocks=args.cache_blocks, pool_blocks=args.pool_blocks,
                           speedup=args.speedup, scheduler=sched)
    except (OSError, ValueError) as e:  # (TraceFormatError is a ValueError)
        raise SystemExit(f"sched_trace: {e}") from None
    bound = infinite_cache_hit_ratio(requests)
    print(describe(config, len(requests)), file=sys.stderr)

    sim_started = time.perf_counter()
    outcomes: dict[PolicyKind, list[RequestOutcome]] = {}
    summaries: dict[PolicyKind, SimSummary] = {}
    for kind in POLICIES:
        outcomes[kind], summaries[kind] = run_policy(kind, requests, config, args.seed,
                                                     kind.value)
    sim_s = time.perf_counter() - sim_started
    reject_cfg = dataclasses.replace(config,
                                     scheduler=dataclasses.replace(sched, early_reject=True))
    _, rejecting = run_policy(PolicyKind.CONDUCTOR, requests, reject_cfg, args.seed,
                              "conductor+reject")
    capacities = [512, 2048, 8192] if args.quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
    curves = capacity_sweep(requests, config, capacities, args.seed)
    index_us, naive_us = index_latency_us()

    report("sched_trace", build_rows(summaries, rejecting, bound, index_us, naive_us, sim_s,
                                     len(requests)), args.json)
    print_details(summaries, rejecting, bound)
    plot(args.png, outcomes, capacities, curves, bound)
    print(f"\nwrote {args.png}; total wall time {time.perf_counter() - started:.1f} s "
          f"on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
