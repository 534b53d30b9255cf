"""Builders and a dense oracle for the kernel tests (test code: clarity over speed)."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


class PagedCase(NamedTuple):
    layer_cache: torch.Tensor  # [num_blocks, 2, bt, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32, garbage past each context
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [len, Hkv, D]
    values: list[torch.Tensor]


def make_paged_case(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, block_tokens: int,
    dtype: torch.dtype = torch.float32, seed: int = 0, share_first_block: bool = False,
    spare_blocks: int = 3,
) -> PagedCase:
    """Random K/V per sequence placed in randomly ordered physical blocks.

    With share_first_block, every sequence's first block is one physical block (and the
    sequences' first block_tokens K/V are equal), as with a shared prefix.
    """
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / block_tokens) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(per_seq) + 1
    tables = torch.randint(-5, num_blocks + 5, (len(seq_lens), max_blocks), generator=gen)  # garbage
    cache = torch.randn(num_blocks, 2, block_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    keys, values, next_free = [], [], 0
    shared = None
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for j in range(per_seq[s]):
            if share_first_block and j == 0 and shared is not None:
                blk = shared
                k[: min(n, block_tokens)] = cache[blk, 0, : min(n, block_tokens)]
                v[: min(n, block_tokens)] = cache[blk, 1, : min(n, block_tokens)]
            else:
                blk = int(perm[next_free])
                next_free += 1
                rows = slice(j * block_tokens, min(n, (j + 1) * block_tokens))
                cache[blk, 0, : rows.stop - rows.start] = k[rows]
                cache[blk, 1, : rows.stop - rows.start] = v[rows]
                if j == 0 and shared is None:
                    shared = blk
            tables[s, j] = blk
        keys.append(k)
        values.append(v)
    return PagedCase(cache, tables.to(torch.int32), torch.tensor(seq_lens, dtype=torch.int32), keys, values)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos: torch.Tensor,
                    window: int | None = None) -> torch.Tensor:
    """Explicit masked softmax for one sequence: q [M, H, D] at positions q_pos [M], k/v [T, Hkv, D];
    with a window W, query p sees keys p - W < t <= p."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [T, H, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,thd->hmt", q.float(), k) * scale  # [H, M, T]
    mask = torch.arange(k.shape[0])[None, :] > q_pos[:, None]  # [M, T]
    if window is not None:
        mask |= torch.arange(k.shape[0])[None, :] <= q_pos[:, None] - window
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hmt,thd->mhd", scores.softmax(-1), v)  # [M, H, D]


def oracle_decode(case: PagedCase, query: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    outs = []
    for b, (k, v) in enumerate(zip(case.keys, case.values)):
        pos = torch.tensor([k.shape[0] - 1])
        outs.append(dense_attention(query[b : b + 1], k, v, scale, pos, window))
    return torch.cat(outs).to(query.dtype)  # [B, H, D]


def oracle_prefill(case: PagedCase, query: torch.Tensor, q_lens: list[int], scale: float,
                   window: int | None = None) -> torch.Tensor:
    outs, start = [], 0
    for b, (k, v) in enumerate(zip(case.keys, case.values)):
        n = k.shape[0]
        pos = torch.arange(n - q_lens[b], n)
        outs.append(dense_attention(query[start : start + q_lens[b]], k, v, scale, pos, window))
        start += q_lens[b]
    return torch.cat(outs).to(query.dtype)  # [total_q, H, D]


def cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[expected.dtype])
