"""Summaries of simulator outcomes: hit ratio, TTFT/TBT percentiles, goodput."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvstore.scheduler.simulator import RequestOutcome


class SimSummary(NamedTuple):
    num_requests: int
    num_finished: int
    num_rejected: int
    hit_ratio: float  # reused blocks / all blocks of all requests (rejected count as misses)
    fetched_ratio: float  # of all blocks, those fetched from another node
    ttft_mean_s: float  # (the TTFT and TBT figures are NaN when no request finished: every
    ttft_p50_s: float   # one rejected read as a TTFT of 0.00)
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_p90_s: float
    goodput_rps: float  # finished requests meeting both SLOs, per second of makespan
    makespan_s: float


def summarize(outcomes: Sequence[RequestOutcome], ttft_slo_s: float,
              tbt_slo_s: float) -> SimSummary:
    """Aggregate one policy's outcomes (all requests, finished or rejected)."""
    done = [o for o in outcomes if o.reject is None]
    total_blocks = sum(o.total_blocks for o in outcomes) or 1
    ttft = np.array([o.ttft_s for o in done]) if done else np.full(1, np.nan)
    tbts = [o.tbt_s for o in done if o.tbt_s is not None]
    tbt = np.array(tbts) if tbts else np.full(1, np.nan)
    good = sum(1 for o in done
               if o.ttft_s <= ttft_slo_s and (o.tbt_s is None or o.tbt_s <= tbt_slo_s))
    start = min((o.arrival_s for o in outcomes), default=0.0)
    end = max((o.finish_s for o in done), default=start)
    makespan = max(end - start, 1e-9)
    return SimSummary(
        num_requests=len(outcomes),
        num_finished=len(done),
        num_rejected=len(outcomes) - len(done),
        hit_ratio=sum(o.hit_blocks for o in done) / total_blocks,
        fetched_ratio=sum(o.fetched_blocks for o in done) / total_blocks,
        ttft_mean_s=float(ttft.mean()),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p90_s=float(np.percentile(ttft, 90)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        tbt_p90_s=float(np.percentile(tbt, 90)),
        goodput_rps=good / makespan,
        makespan_s=makespan,
    )
