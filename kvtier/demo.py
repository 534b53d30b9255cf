"""`kvtier demo`: one workload on three clusters of the same workers, to show what the pool
is for.

(a) colocated workers, no pool (the baseline): each worker reuses only its own paged cache;
(b) the same colocated workers sharing the pool (a `kvtier serve` store node): every
    prefix any worker computed is a hit for all of them, long after it left their caches;
(c) prefill/decode workers over the pool (Mooncake's split): prefill workers compute
    only the uncached suffix and stream the blocks to the pool; decode workers load them
    and stream the answer, away from prefill chunks.
Same model, same number of worker processes, same per-worker paged cache (small on
purpose, as GPU memory is next to a real working set), same requests, replayed by
`--sessions` users holding multi-turn conversations (`kvtier.replay`). The table gives
each figure of (b) and (c) with its ratio to (a) (> 1 = better than the baseline).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import replace
from typing import NamedTuple

from aiohttp import web

from engine_adapter.serving.launcher import ClusterConfig, cluster_processes, cpu_plan
from kvtier.replay import RunResult, replay
from kvtier.demo_report import chart, report
from kvtier.workload import WORKLOADS, hit_ratio_bound, load
from kvstore.config import parse_size
from kvstore.errors import KVStoreError

SAMPLE_CHAT = [{"role": "system", "content": "You are a concise assistant."},
               {"role": "user", "content": "In one sentence, why reuse a KV cache?"}]


class Setup(NamedTuple):
    key: str          # a, b, c
    name: str
    cfg: ClusterConfig


def setups(a: argparse.Namespace) -> list[Setup]:
    base = ClusterConfig(num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs,
                         chunk_tokens=a.chunk_tokens, dram_size=a.dram_size, quiet_workers=True,
                         port=0)
    n, prefill = a.workers, max(1, a.workers // 2)
    every = {"a": lambda: Setup("a", f"(a) {n} colocated, no pool",
                                replace(base, colocated=n, pool=False)),
             "b": lambda: Setup("b", f"(b) {n} colocated + pool",
                                replace(base, colocated=n, pool=True)),
             "c": lambda: Setup("c", f"(c) {prefill}P+{n - prefill}D + pool",
                                replace(base, prefill=prefill, decode=n - prefill))}
    # only the chosen ones are made: (c)'s config refused --workers 1, which (a) and (b) run
    return [every[key]() for key in "abc" if key in a.configs]


async def run_one(s: Setup, workload, a: argparse.Namespace, ask: bool) -> tuple[RunResult, str]:
    from engine_adapter.serving.frontend import FrontendConfig, create_app

    with cluster_processes(s.cfg) as router:
        t0 = time.perf_counter()
        print(f"{s.name}: starting {', '.join(n for n, _ in s.cfg.roles)}"
              f"{' and a store node' if s.cfg.pooled else ''} (each worker loads the model and "
              "measures its speed)...", flush=True)
        runner = web.AppRunner(create_app(FrontendConfig(), router))
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port = runner.addresses[0][1]
            print(f"{s.name}: ready in {time.perf_counter() - t0:.0f} s; "
                  f"{router.cost_summary()}", flush=True)
            url = f"http://127.0.0.1:{port}"
            result = await replay(url, workload, a.sessions, s.name, a.think, a.stagger)
            answer = await _completion(url) if ask else ""
        finally:
            await runner.cleanup()
    return result, answer


async def _completion(url: str) -> str:
    import aiohttp
    body = {"messages": SAMPLE_CHAT, "max_tokens": 40, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            msg = await r.json()
    return msg["choices"][0]["message"]["content"] if "choices" in msg else str(msg)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="long", help="long (default: long-context multi-turn "
                   "conversations from Mooncake's trace), short (the first demo's 157-token "
                   "prompts) or a Mooncake-format JSONL path")
    p.add_argument("--requests", type=int, default=None, help="replay only the first N")
    p.add_argument("--sessions", type=int, default=6,
                   help="users holding conversations at once (default 6)")
    p.add_argument("--stagger", type=float, default=None, metavar="SECONDS",
                   help="users join this far apart (default: each once the previous "
                   "newcomer got its first token)")
    p.add_argument("--think", type=float, default=2.0,
                   help="seconds a user thinks before the next turn (default 2)")
    p.add_argument("--workers", type=int, default=2, help="worker processes in every "
                   "configuration (default 2; (c) splits them into prefill and decode)")
    p.add_argument("--num-blocks", type=int, default=128,
                   help="each worker's paged KV cache in 16-token blocks (default 128 = 2k "
                   "tokens: the longest context, while the users hold 6 conversations; GPU "
                   "memory is as short of a real working set)")
    p.add_argument("--max-num-seqs", type=int, default=1,
                   help="requests each worker runs at once (default 1: its KV memory holds one)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="prefill chunk (default 256)")
    p.add_argument("--dram-size", default="1GiB", help="the pool's DRAM (default 1GiB)")
    p.add_argument("--ttft-slo", type=float, default=5.0,
                   help="TTFT SLO in seconds for goodput (default 5)")
    p.add_argument("--configs", default="abc", help="which of a, b, c to run, in order (default "
                   "abc); the first is the baseline of the ratios")
    p.add_argument("--chart", default="kvtier-demo-ttft.png", help="PNG chart path")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def _check(a: argparse.Namespace) -> str | None:
    if a.workload not in WORKLOADS and not a.workload.endswith(".jsonl"):
        return f"--workload {a.workload!r}: use long, short or a .jsonl file"
    if not a.configs or set(a.configs) - set("abc"):
        return f"--configs {a.configs!r}: letters among a, b, c (e.g. abc or ab)"
    if a.workers < ("c" in a.configs) + 1:
        return "--workers: (c) needs at least 2 (one prefill, one decode)"
    if a.workload.endswith(".jsonl") and not os.path.isfile(a.workload):
        return f"--workload {a.workload}: no such file"
    for name in ("requests", "sessions", "num_blocks"):
        value = getattr(a, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be 1 or more, not {value}"
    try:
        pool = parse_size(a.dram_size)
    except (ValueError, KVStoreError) as e:
        return f"--dram-size {a.dram_size!r}: {e}"
    if pool <= 0 and set(a.configs) & set("bc"):  # (found when (b) started its store,
        return "--dram-size must be more than 0: setups (b) and (c) share a pool"  # after (a))
    return None


def run(a: argparse.Namespace) -> int:
    problem = _check(a)
    try:
        chosen = setups(a)  # (the worker settings ClusterConfig checks: a traceback before)
    except ValueError as e:
        problem = problem or str(e)
    if problem:
        print(f"kvtier demo: {problem}", file=sys.stderr)
        return 2
    try:
        workload = load(a.workload, limit=a.requests)
    except ValueError as e:  # (a trace line that is not a request: TraceFormatError names it)
        print(f"kvtier demo: --workload {a.workload}: {e}", file=sys.stderr)
        return 2
    bound = hit_ratio_bound(workload)
    t0 = time.perf_counter()
    lens = [len(r.prompt_token_ids) for r in workload]
    print(f"kvtier demo: {len(workload)} requests in {len({r.conversation for r in workload})} "
          f"conversations, prompts {min(lens)}-{max(lens)} tokens "
          f"(mean {sum(lens) / len(lens):.0f}),"
          f" {a.sessions} users thinking {a.think:g} s between turns, {a.num_blocks} KV blocks "
          "per worker; "
          f"{cpu_plan(chosen[0].cfg).describe(chosen[0].cfg)}", flush=True)
    results = []
    for i, s in enumerate(chosen):
        result, answer = asyncio.run(run_one(s, workload, a, ask=i == len(chosen) - 1))
        results.append(result)
    report(results, bound, a.ttft_slo, a.json)
    print(f"\none real completion ({chosen[-1].name}, greedy):\n  Q: {SAMPLE_CHAT[-1]['content']}"
          f"\n  A: {answer.strip()}")
    chart(results, a.chart)
    print(f"TTFT chart: {a.chart}\nkvtier demo finished in {time.perf_counter() - t0:.0f} s")
    failed = sum(r.failed for r in results)
    if failed:
        print(f"{failed} request(s) failed", file=sys.stderr)
    return 1 if failed else 0
