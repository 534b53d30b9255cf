"""`kvtier demo`: the same workload on the pooled cluster and on the colocated baseline.

Run 1 ("pool"): a `kvtier serve` store node, 1 prefill + 1 decode worker, conductor routing.
Run 2 ("colocated"): 2 workers doing prefill and decode, no shared pool, the same routing
over their own caches. Both use the same model, the same per-worker paged cache (small on
purpose: a GPU's KV memory is the scarce thing the pool backs with DRAM) and the same
requests, sent by a closed loop of `--concurrency` clients in trace order, streamed.
Figures come from the client side (TTFT = first streamed token, TPOT = the rest / their
count) and from `usage.prompt_tokens_details.cached_tokens` (the prefix hit ratio).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import aiohttp
from aiohttp import web

from engine_adapter.serving.launcher import ROOT, ClusterConfig, cluster_processes, free_port
from engine_adapter.serving.workload import WorkloadRequest, load

DEFAULT_WORKLOAD = os.path.join(ROOT, "tests", "data", "demo_workload.jsonl")
SAMPLE_CHAT = [{"role": "system", "content": "You are a concise assistant."},
               {"role": "user", "content": "In one sentence, why reuse a KV cache?"}]


class Sample(NamedTuple):
    ttft_s: float
    tpot_s: float | None
    prompt_tokens: int
    cached_tokens: int
    ok: bool


@dataclass(frozen=True)
class RunResult:
    name: str
    samples: tuple[Sample, ...]
    wall_s: float
    completion: str

    def pct(self, field: str, q: float) -> float:
        xs = sorted(x for x in (getattr(s, field) for s in self.samples if s.ok) if x is not None)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def hit_ratio(self) -> float:
        ok = [s for s in self.samples if s.ok]
        return sum(s.cached_tokens for s in ok) / max(1, sum(s.prompt_tokens for s in ok))

    @property
    def rps(self) -> float:
        return sum(s.ok for s in self.samples) / self.wall_s


async def _one(session: aiohttp.ClientSession, url: str, req: WorkloadRequest) -> Sample:
    body = {"prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start, first, last, usage = time.perf_counter(), None, None, None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    print(f"request {req.index} failed: {msg['error']['message']}", file=sys.stderr)
                    return Sample(0.0, None, 0, 0, False)
                if msg.get("usage"):
                    usage = msg["usage"]
                elif msg["choices"]:
                    last = time.perf_counter()
                    first = first if first is not None else last
    except aiohttp.ClientError as e:
        print(f"request {req.index} failed: {e}", file=sys.stderr)
        return Sample(0.0, None, 0, 0, False)
    if first is None or usage is None:
        return Sample(0.0, None, 0, 0, False)
    tokens = usage["completion_tokens"]
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(first - start, tpot, usage["prompt_tokens"],
                  usage["prompt_tokens_details"]["cached_tokens"], True)


async def _replay(url: str, workload: list[WorkloadRequest], concurrency: int, name: str
                  ) -> tuple[list[Sample], float]:
    from tqdm import tqdm

    samples: list[Sample | None] = [None] * len(workload)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(workload)):
        queue.put_nowait(i)
    bar = tqdm(total=len(workload), desc=f"{name:>9}", unit="req", file=sys.stdout)

    async def client(session):
        while not queue.empty():
            i = queue.get_nowait()
            samples[i] = await _one(session, url, workload[i])
            bar.update(1)

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    bar.close()
    return samples, time.perf_counter() - start


async def _completion(url: str) -> str:
    body = {"messages": SAMPLE_CHAT, "max_tokens": 40, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            msg = await r.json()
    return msg["choices"][0]["message"]["content"] if "choices" in msg else str(msg)


async def _run_cluster(cfg: ClusterConfig, workload, concurrency: int, name: str) -> RunResult:
    from engine_adapter.serving.frontend import FrontendConfig, create_app

    with cluster_processes(cfg) as router:
        runner = web.AppRunner(create_app(FrontendConfig(), router))
        t0 = time.perf_counter()
        print(f"[{name}] starting {', '.join(n for n, _ in cfg.roles)} "
              f"({'store node + ' if not cfg.colocated else ''}model load in each worker)...",
              flush=True)
        await runner.setup()
        try:
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            print(f"[{name}] ready in {time.perf_counter() - t0:.0f} s", flush=True)
            url = f"http://127.0.0.1:{port}"
            samples, wall = await _replay(url, workload, concurrency, name)
            completion = await _completion(url)
        finally:
            await runner.cleanup()
    return RunResult(name, tuple(samples), wall, completion)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, help="Mooncake-format JSONL "
                   "(default: the committed sample derived from Mooncake's conversation trace)")
    p.add_argument("--requests", type=int, default=None, help="replay only the first N")
    p.add_argument("--concurrency", type=int, default=4, help="clients in the closed loop")
    p.add_argument("--num-blocks", type=int, default=96,
                   help="each worker's paged KV cache in 16-token blocks (default 96)")
    p.add_argument("--chart", default="kvtier-demo-ttft.png", help="PNG chart path")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(a: argparse.Namespace) -> int:
    workload = load(a.workload, limit=a.requests)
    t0 = time.perf_counter()
    base = ClusterConfig(num_blocks=a.num_blocks, quiet_workers=True, port=0)
    print(f"kvtier demo: {len(workload)} requests "
          f"({sum(len(w.prompt_token_ids) for w in workload)} prompt tokens), "
          f"{a.concurrency} concurrent clients, {a.num_blocks} KV blocks per worker", flush=True)
    pool = asyncio.run(_run_cluster(replace(base, prefill=1, decode=1), workload,
                                    a.concurrency, "pool"))
    colo = asyncio.run(_run_cluster(replace(base, colocated=2), workload, a.concurrency,
                                    "colocated"))
    _report(pool, colo, a.json)
    print(f"(every prompt block this workload could ever share: hit ratio bound "
          f"{hit_ratio_bound(workload):.3f}, an infinite cache)")
    print(f"\none real completion (pool cluster, greedy):\n  Q: {SAMPLE_CHAT[-1]['content']}\n"
          f"  A: {pool.completion.strip()}")
    _chart(pool, colo, a.chart)
    print(f"TTFT chart: {a.chart}\nkvtier demo finished in {time.perf_counter() - t0:.0f} s")
    failed = sum(not s.ok for r in (pool, colo) for s in r.samples)
    if failed:
        print(f"{failed} request(s) failed", file=sys.stderr)
    return 1 if failed else 0


def hit_ratio_bound(workload: list[WorkloadRequest], block_tokens: int = 16) -> float:
    """Hit ratio of an infinite cache: each prompt's leading blocks seen in an earlier prompt."""
    seen: set[tuple[int, ...]] = set()
    hit = 0
    for r in workload:
        prefixes = [r.prompt_token_ids[:block_tokens * (i + 1)]
                    for i in range(len(r.prompt_token_ids) // block_tokens)]
        first_miss = next((i for i, p in enumerate(prefixes) if p not in seen), len(prefixes))
        hit += block_tokens * first_miss
        seen.update(prefixes)
    return hit / max(1, sum(len(r.prompt_token_ids) for r in workload))


def _report(pool: RunResult, colo: RunResult, json_path: str | None) -> None:
    from kvtier.report import Row, report
    base = "colocated, no pool"
    rows = [Row("prefix hit ratio", "ratio", pool.hit_ratio, base, colo.hit_ratio)]
    for field, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        for q, qn in ((0.5, "p50"), (0.9, "p90")):
            rows.append(Row(f"{label} {qn}", "s", pool.pct(field, q), base, colo.pct(field, q)))
    rows.append(Row("throughput", "req/s", pool.rps, base, colo.rps))
    print("\npool (1 prefill + 1 decode, kvtier store) vs colocated baseline (2 workers, no pool);"
          " ratio > 1 = the pool is better")
    report("demo", rows, json_path)


def _chart(pool: RunResult, colo: RunResult, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for r, style in ((colo, "o-"), (pool, "s-")):
        ax.plot([s.ttft_s if s.ok else float("nan") for s in r.samples], style, ms=3,
                label=f"{r.name} (p50 {r.pct('ttft_s', 0.5):.2f} s)")
    ax.set_xlabel("request (trace order)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("kvtier demo: TTFT per request, pooled KV cache vs colocated baseline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
