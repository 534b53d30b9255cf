"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed.

Each request samples with its own `torch.Generator`, so a seeded request draws the same
tokens whatever else shares its batch, and its state can be handed from a prefill worker
to a decode worker.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import torch

from engine_adapter.errors import InvalidRequestError


MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's _SAMPLING_EPS)
MAX_TOKENS = 1 << 31  # (a request cannot run longer than its context allows anyway)


MAX_STOPS = 16  # stop strings a request may give (OpenAI's API takes 4)
MAX_STOP_CHARS = 1024


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
        if type(self.max_tokens) is not int or not 0 < self.max_tokens <= MAX_TOKENS:
            raise InvalidRequestError(f"max_tokens must be an integer in [1, {MAX_TOKENS}], "
                                      f"got {self.max_tokens!r}")
        if self.seed is not None and (type(self.seed) is not int
                                      or not -(1 << 63) <= self.seed < 1 << 64):
            # (2**70 passed, and failed as a 500 when the request went to its worker; a
            # torch generator takes [-2**63, 2**64))
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64), got "
                                      f"{self.seed!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:  # (1e-50 divided the logits into inf and NaN:
            object.__setattr__(self, "temperature", 0.0)  # the sampler raised, and took the
            # worker's engine thread with it) as vLLM does, a temperature this small is greedy
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if type(self.top_k) is not int or not 0 <= self.top_k < 1 << 31:  # (2.5 passed, and
            # the sampler's gather raised in the engine's step; 10**30 failed as a 500 when
            # the request was packed for its worker)
            raise InvalidRequestError(f"top_k must be an integer in [0, 2**31) (0 = off), got "
                                      f"{self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            # (each is looked for after every token: 1,000 of 1,000 characters cost the
            # engine thread 0.2 s a step, for every request on the worker)
            raise InvalidRequestError(f"at most {MAX_STOPS} stop strings of at most "
                                      f"{MAX_STOP_CHARS} characters each")

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


def _filter_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p applied to rows `[n, V]` at once (a new tensor); one
    sort serves both filters."""
    n, vocab = logits.shape
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)  # [n]
    logits = logits / temps[:, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])  # [n]
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)  # [n]
    if bool((top_k >= vocab).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)  # [n, V]
    kth = sorted_logits.gather(1, (top_k - 1)[:, None])  # [n, 1]: ties with the k-th stay in
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p[:, None]  # mass before this token already enough
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of `logits [B, V]` (float32). The filters run over all sampled rows
    at once; only the draw is per row, from each request's own generator, so a seeded
    request draws the same tokens whatever shares its batch."""
    out = logits.argmax(-1).tolist()  # greedy rows, and a placeholder for the rest
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    probs = _filter_rows(logits[rows], [params[i] for i in rows]).softmax(-1)  # [n, V]
    for probs_row, i in zip(probs, rows):
        out[i] = int(torch.multinomial(probs_row, 1, generator=generators[i]))
    return out
