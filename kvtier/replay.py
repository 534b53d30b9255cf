"""The demo's clients: conversations replayed against an OpenAI endpoint, as users would.

`sessions` users talk at once. Each takes the next conversation and sends its turns one
after another, each turn once the previous answer has fully arrived and the user has
thought for `think_s` (meanwhile the others' turns run, as on a busy server). Users join
one by one, each once the previous newcomer got its first token (or `stagger_s` apart):
the load ramps up as fast as the cluster takes it, whatever else the machine is doing, and
two first turns never race for a shared prefix neither has computed. Every request streams,
with `ignore_eos` (the workload fixes how many tokens each answer has). Figures are the
client's: TTFT = first streamed token, TPOT = the rest over their count, cached tokens
from `usage`.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp

from kvtier.workload import WorkloadRequest


class Sample(NamedTuple):
    ttft_s: float
    tpot_s: float | None
    prompt_tokens: int
    cached_tokens: int
    ok: bool


FAILED = Sample(0.0, None, 0, 0, False)


@dataclass(frozen=True)
class RunResult:
    name: str
    samples: tuple[Sample, ...]     # in workload order
    wall_s: float
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-min load average, start and end

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

    def goodput(self, ttft_slo_s: float) -> float:
        """Requests per second that met the TTFT SLO."""
        return sum(s.ok and s.ttft_s <= ttft_slo_s for s in self.samples) / self.wall_s

    @property
    def failed(self) -> int:
        return sum(not s.ok for s in self.samples)


async def one(session: aiohttp.ClientSession, url: str, req: WorkloadRequest,
              first_token: asyncio.Event | None = None) -> Sample:
    """One streamed request; sets `first_token` once its first token came (or it ended)."""
    try:
        return await _one(session, url, req, first_token or asyncio.Event())
    finally:
        if first_token is not None:
            first_token.set()


async def _one(session: aiohttp.ClientSession, url: str, req: WorkloadRequest,
               first_token: asyncio.Event) -> Sample:
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
                    return FAILED
                if msg.get("usage"):
                    usage = msg["usage"]
                elif msg["choices"]:
                    last = time.perf_counter()
                    first = first if first is not None else last
                    first_token.set()
    except aiohttp.ClientError as e:
        print(f"request {req.index} failed: {e}", file=sys.stderr)
        return FAILED
    if first is None or usage is None:
        return FAILED
    tokens = usage["completion_tokens"]
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(first - start, tpot, usage["prompt_tokens"],
                  usage["prompt_tokens_details"]["cached_tokens"], True)


def conversations(workload: list[WorkloadRequest]) -> list[list[WorkloadRequest]]:
    """Conversations in order of their first request, each turn after turn."""
    by_id: dict[int, list[WorkloadRequest]] = {}
    for r in workload:
        by_id.setdefault(r.conversation, []).append(r)
    return [sorted(c, key=lambda r: r.turn) for c in by_id.values()]


async def replay(url: str, workload: list[WorkloadRequest], sessions: int, name: str,
                 think_s: float = 0.0, stagger_s: float | None = None) -> RunResult:
    """`stagger_s`: users join this far apart; None: each after the previous newcomer's
    first token."""
    from tqdm import tqdm

    samples: list[Sample] = [FAILED] * len(workload)
    position = {r.index: i for i, r in enumerate(workload)}
    todo = conversations(workload)
    joined = [asyncio.Event() for _ in range(sessions + 1)]
    joined[0].set()
    bar = tqdm(total=len(workload), desc=f"{name:>22}", unit="req", file=sys.stdout)

    async def user(k: int, http: aiohttp.ClientSession) -> None:
        await (joined[k].wait() if stagger_s is None else asyncio.sleep(k * stagger_s))
        while todo:
            for t, turn in enumerate(todo.pop(0)):
                if t:
                    await asyncio.sleep(think_s)
                samples[position[turn.index]] = await one(http, url, turn, joined[k + 1])
                bar.update(1)
        joined[k + 1].set()  # no conversation left for this user: the next one need not wait

    start, load = time.perf_counter(), os.getloadavg()[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(user(k, http) for k in range(sessions)))
    bar.close()
    return RunResult(name, tuple(samples), time.perf_counter() - start,
                     (load, os.getloadavg()[0]))
