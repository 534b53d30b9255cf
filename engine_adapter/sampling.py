"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed.

Each request samples with its own `torch.Generator`, so a seeded request draws the same
tokens whatever else shares its batch, and its state can be handed from a prefill worker
to a decode worker.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import torch

from engine_adapter.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0              # nucleus: keep the smallest set with this much mass
    top_k: int = 0                  # 0 = off
    seed: int | None = None         # per-request generator seed; None = fresh entropy
    max_tokens: int = 16
    stop: tuple[str, ...] = ()      # stop strings (checked on the detokenized output)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """From request JSON; unknown keys are an error, not silently ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def make_generator(self) -> torch.Generator:
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to one row of logits `[V]` (a new tensor)."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # mass before this token already enough
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of `logits [B, V]` (float32)."""
    out = logits.argmax(-1).tolist()  # greedy rows, and a placeholder for the rest
    for i, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = _filter(logits[i], p).softmax(-1)
            out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out
