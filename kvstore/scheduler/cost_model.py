"""Cost model the scheduler uses to estimate time to first token and time between tokens.

Three parts, each with explicit parameters and a least-squares fit from measured timings so
a deployment can calibrate it to its own hardware:

- prefill:  t = base_s + per_token_s * n + per_token_pair_s * (n * p + n^2 / 2)
            for n new tokens after a cached prefix of p tokens. The last term is attention:
            each new token attends to the prefix and to the new tokens before it.
- decode:   one step of a continuous batch of b sequences holding k KV tokens in total,
            t = base_s + per_seq_s * b + per_kv_token_s * k (weights read once, KV read per
            token: a memory-bound step).
- transfer: fetching blocks from another node, per source tier,
            t = latency_s + bytes / bytes_per_s.

`llama2_70b_like()` gives defaults shaped like Mooncake's paper setup (LLaMA2-70B on an
8-GPU A800 instance, RDMA between instances); the derivation is next to each number.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvstore.events import TierKind


class FitError(ValueError):
    """Too few or degenerate samples to fit a cost model."""


def _check_non_negative(owner: object, **values: float) -> None:
    for name, value in values.items():
        if not value >= 0:  # also rejects NaN
            raise ValueError(f"{type(owner).__name__}.{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class PrefillCost:
    base_s: float
    per_token_s: float
    per_token_pair_s: float

    def __post_init__(self) -> None:
        _check_non_negative(self, base_s=self.base_s, per_token_s=self.per_token_s,
                            per_token_pair_s=self.per_token_pair_s)

    def time_s(self, new_tokens: int, prefix_tokens: int) -> float:
        """Seconds to prefill `new_tokens` after `prefix_tokens` already cached."""
        n, p = float(new_tokens), float(prefix_tokens)
        return self.base_s + self.per_token_s * n + self.per_token_pair_s * (n * p + n * n / 2)


@dataclass(frozen=True)
class DecodeCost:
    base_s: float
    per_seq_s: float
    per_kv_token_s: float

    def __post_init__(self) -> None:
        _check_non_negative(self, base_s=self.base_s, per_seq_s=self.per_seq_s,
                            per_kv_token_s=self.per_kv_token_s)

    def step_s(self, batch_size: int, kv_tokens: int) -> float:
        """Seconds for one decode step of `batch_size` sequences over `kv_tokens` KV."""
        return self.base_s + self.per_seq_s * batch_size + self.per_kv_token_s * kv_tokens


@dataclass(frozen=True)
class LinkCost:
    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        _check_non_negative(self, latency_s=self.latency_s)
        if not self.bytes_per_s > 0:
            raise ValueError(f"LinkCost.bytes_per_s must be > 0, got {self.bytes_per_s}")

    def time_s(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True)
class TransferCost:
    """Fetching blocks held by another node, by the tier they sit in there."""

    gpu: LinkCost
    dram: LinkCost
    ssd: LinkCost

    def link(self, tier: TierKind) -> LinkCost:
        return (self.gpu, self.dram, self.ssd)[tier]

    def fetch_s(self, tiers: Sequence[TierKind], block_bytes: int) -> float:
        """Seconds to fetch one block from each of `tiers` (0 when nothing to fetch)."""
        if not tiers:
            return 0.0
        per_tier = [0, 0, 0]
        for tier in tiers:
            per_tier[tier] += 1
        links = (self.gpu, self.dram, self.ssd)
        latency = max(links[t].latency_s for t in set(tiers))
        return latency + sum(n * block_bytes / links[t].bytes_per_s
                             for t, n in enumerate(per_tier) if n)


@dataclass(frozen=True)
class CostModel:
    prefill: PrefillCost
    decode: DecodeCost
    transfer: TransferCost
    block_tokens: int
    block_bytes: int

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.block_bytes <= 0:
            raise ValueError("CostModel.block_tokens and block_bytes must be > 0")


def llama2_70b_like(block_tokens: int = 512) -> CostModel:
    """Defaults resembling Mooncake's setup: LLaMA2-70B, one 8xA800 node per instance.

    - Linear layers: 2 * 70e9 FLOP/token; 8 GPUs * 312 TFLOP/s at ~50% MFU = 1.25e15
      FLOP/s, so per_token_s = 1.12e-4 (about 8.9k tokens/s).
    - Attention: 4 * 80 layers * 8192 dims = 2.6e6 FLOP per (token, context token) pair,
      so per_token_pair_s = 2.1e-9.
    - KV per token: 80 layers * 2 * 8 KV heads * 128 dims * 2 bytes = 320 KiB, so a
      512-token block is 160 MiB.
    - Decode: read 140 GB of weights from 8 * 2 TB/s HBM at ~60%: base_s = 0.015;
      per_kv_token_s = 320 KiB / 9.6 TB/s = 3.4e-8; per_seq_s = 1e-4.
    - Transfer between instances: 8 x 200 Gbps RDMA, taken as ~100 GB/s effective from a
      remote node's DRAM or HBM (Mooncake reports up to ~190 GB/s), 5 GB/s from its SSD.
    """
    kv_bytes_per_token = 80 * 2 * 8 * 128 * 2
    return CostModel(
        prefill=PrefillCost(base_s=0.02, per_token_s=1.12e-4, per_token_pair_s=2.1e-9),
        decode=DecodeCost(base_s=0.015, per_seq_s=1e-4, per_kv_token_s=3.4e-8),
        transfer=TransferCost(
            gpu=LinkCost(latency_s=1e-3, bytes_per_s=100e9),
            dram=LinkCost(latency_s=1e-3, bytes_per_s=100e9),
            ssd=LinkCost(latency_s=2e-3, bytes_per_s=5e9),
        ),
        block_tokens=block_tokens,
        block_bytes=kv_bytes_per_token * block_tokens,
    )


# ---- fitting from measured timings ------------------------------------------------------
class PrefillSample(NamedTuple):
    new_tokens: int
    prefix_tokens: int
    seconds: float


class DecodeSample(NamedTuple):
    batch_size: int
    kv_tokens: int
    seconds: float


class TransferSample(NamedTuple):
    num_bytes: int
    seconds: float


def _nonneg_lstsq(features: np.ndarray, target: np.ndarray, what: str) -> np.ndarray:
    """Least squares with coefficients clipped at 0, refitting the rest once clipped.

    Columns are scaled to unit norm first: raw features span ~10 orders of magnitude.
    """
    if features.shape[0] < features.shape[1]:
        raise FitError(f"{what}: need at least {features.shape[1]} samples, "
                       f"got {features.shape[0]}")
    scale = np.linalg.norm(features, axis=0)
    if np.any(scale == 0):
        raise FitError(f"{what}: a feature is zero in every sample; vary the inputs")
    active = np.ones(features.shape[1], dtype=bool)
    coef = np.zeros(features.shape[1])
    for _ in range(features.shape[1]):
        scaled = features[:, active] / scale[active]
        if np.linalg.matrix_rank(scaled) < scaled.shape[1]:
            raise FitError(f"{what}: samples do not separate the parameters; vary them more")
        sol, *_ = np.linalg.lstsq(scaled, target, rcond=None)
        coef[:] = 0
        coef[active] = sol / scale[active]
        if np.all(coef >= 0):
            break
        active &= coef > 0
    return np.clip(coef, 0, None)


def fit_prefill(samples: Sequence[PrefillSample]) -> PrefillCost:
    """Fit `PrefillCost` to measured prefill timings (vary both new and prefix tokens)."""
    n = np.array([s.new_tokens for s in samples], dtype=float)
    p = np.array([s.prefix_tokens for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    x = np.column_stack([np.ones_like(n), n, n * p + n * n / 2])
    base, per_token, pair = _nonneg_lstsq(x, y, "fit_prefill")
    return PrefillCost(float(base), float(per_token), float(pair))


def fit_decode(samples: Sequence[DecodeSample]) -> DecodeCost:
    """Fit `DecodeCost` to measured decode step timings (vary batch size and KV length).
    Samples of one batch size only (an engine that runs one sequence at a time) fit the
    step time and the KV term; the per-sequence cost is then folded into the base."""
    b = np.array([s.batch_size for s in samples], dtype=float)
    k = np.array([s.kv_tokens for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    if b.size and np.all(b == b[0]):
        base, per_kv = _nonneg_lstsq(np.column_stack([np.ones_like(b), k]), y, "fit_decode")
        return DecodeCost(float(base), 0.0, float(per_kv))
    base, per_seq, per_kv = _nonneg_lstsq(np.column_stack([np.ones_like(b), b, k]), y,
                                          "fit_decode")
    return DecodeCost(float(base), float(per_seq), float(per_kv))


def fit_link(samples: Sequence[TransferSample]) -> LinkCost:
    """Fit latency and bandwidth of one link to (bytes, seconds) timings."""
    nbytes = np.array([s.num_bytes for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    latency, per_byte = _nonneg_lstsq(np.column_stack([np.ones_like(nbytes), nbytes]), y,
                                      "fit_link")
    if per_byte <= 0:
        raise FitError("fit_link: time does not grow with size; use larger transfers")
    return LinkCost(float(latency), float(1.0 / per_byte))
