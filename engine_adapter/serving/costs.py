"""The router's cost model, fitted at cluster start to what the workers measured on this
machine (`serving.calibrate`): prefill from the workers that prefill, decode from those that
decode, the pool link from timed reads of the pool. Nothing here is a hand-set figure.
"""
from __future__ import annotations

from kvstore.scheduler.cost_model import (CostModel, LinkCost, TransferCost, fit_decode,
                                          fit_link, fit_prefill)

from engine_adapter.serving.protocol import Role, WorkerInfo

# Without a pool nothing is ever fetched, so the link is never priced; this stands in.
NO_LINK = LinkCost(latency_s=0.0, bytes_per_s=float("inf"))


def fit_cost_model(infos: list[WorkerInfo], block_tokens: int, block_bytes: int) -> CostModel:
    """Raises `kvstore.scheduler.cost_model.FitError` when the samples cannot be fitted."""
    prefill = [s for i in infos if i.role is not Role.DECODE for s in i.prefill_samples]
    decode = [s for i in infos if i.role is not Role.PREFILL for s in i.decode_samples]
    loads = [s for i in infos for s in i.load_samples]
    # Blocks are fetched from the pool's DRAM; its SSD tier (when configured) and the
    # workers' own memory are priced like it, since only DRAM reads were measured.
    link = fit_link(loads) if loads else NO_LINK
    return CostModel(fit_prefill(prefill), fit_decode(decode),
                     TransferCost(gpu=link, dram=link, ssd=link), block_tokens, block_bytes)


def describe(cost: CostModel) -> str:
    """One line for the start-up banner: what the fit says this machine does."""
    p, link = cost.prefill, cost.transfer.dram
    per_1k = p.time_s(1024, 0)
    load = ("no pool" if link is NO_LINK else
            f"pool reads {link.bytes_per_s / 1e9:.1f} GB/s + {link.latency_s * 1e3:.1f} ms")
    return (f"fitted: prefill 1k tokens {per_1k:.2f} s, decode step "
            f"{cost.decode.step_s(1, 1024) * 1e3:.0f} ms, {load}")
