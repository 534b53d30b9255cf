"""What a block codec does to a model's output, measured against the raw cache on a
transformers model (the oracle): the prefix's KV comes from blocks (raw, or decoded from a
codec), then the raw run's own continuation is fed back (teacher forcing: one near-tie
cannot cascade) and the next-token distributions are compared position by position.

    raw = prefix_logits(model, raw_blocks, feed)        # [T, vocab]
    got = prefix_logits(model, decoded_blocks, feed)
    q = compare(raw, got, targets)                      # top-1 agreement, KL, NLLs

Used by bench/compression.py and the quality test on SmolLM2.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine_adapter.plugins.hf import blocks_to_cache


class Quality(NamedTuple):
    num_tokens: int
    top1_agree: int       # positions whose argmax equals the raw run's
    kl_sum: float         # sum over positions of KL(raw || codec), nats
    nll_raw: float        # sum of -log p_raw(target)
    nll_codec: float      # sum of -log p_codec(target)

    def __add__(self, other: "Quality") -> "Quality":  # type: ignore[override]
        return Quality(*(a + b for a, b in zip(self, other)))

    @property
    def agreement(self) -> float:
        return self.top1_agree / self.num_tokens

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.num_tokens

    @property
    def nll_change(self) -> float:
        """Relative change of the continuation's NLL, (codec - raw) / raw."""
        return (self.nll_codec - self.nll_raw) / self.nll_raw


@torch.inference_mode()
def prefix_logits(model, blocks: torch.Tensor, feed: torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] (fp32) of `feed` [T] token ids run after the prefix whose KV is
    `blocks` [n, L, 2, bt, Hkv, D] (batch 1)."""
    cache = blocks_to_cache(blocks.to(model.dtype), model.config)
    n_prefix = blocks.shape[0] * blocks.shape[3]
    positions = torch.arange(n_prefix, n_prefix + feed.shape[0]).unsqueeze(0)
    out = model(input_ids=feed.unsqueeze(0), cache=cache, position_ids=positions, use_cache=True)
    return out.logits[0].float()


def compare(raw: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> Quality:
    """Position-wise comparison of two logit rows [T, vocab]; `targets` [T] are the tokens
    that followed (the raw run's continuation)."""
    lp_raw, lp_got = raw.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_raw.exp() * (lp_raw - lp_got)).sum(-1)
    pick = targets.unsqueeze(-1)
    return Quality(int(targets.shape[0]), int((raw.argmax(-1) == got.argmax(-1)).sum()),
                   float(kl.sum()), float(-lp_raw.gather(-1, pick).sum()),
                   float(-lp_got.gather(-1, pick).sum()))


@torch.inference_mode()
def greedy(model, blocks: torch.Tensor, feed: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Free-running: `num_tokens` greedy tokens after the prefix whose KV is `blocks` and
    `feed` (the prompt's uncached tail, at least one token)."""
    cache = blocks_to_cache(blocks.to(model.dtype), model.config)
    n_prefix = blocks.shape[0] * blocks.shape[3]
    # the cached positions' ids are never read (their KV is in the cache): placeholders
    ids = torch.cat([torch.zeros(n_prefix, dtype=torch.long), feed]).unsqueeze(0)
    out = model.generate(ids, cache=cache, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                         do_sample=False)
    return out[0, ids.shape[1]:]
