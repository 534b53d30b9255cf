"""Triton paged decode attention (GQA), with a split-K (flash-decoding) variant.

One program per (sequence, KV head, split): it loads the group of query heads that share
the KV head once ([GROUP_PAD, D], padded to 16 rows for tl.dot), walks its share of the
context BLOCK_N tokens at a time through the block table, and keeps an online softmax in
base 2. Unsplit, it writes the output; split, it writes a normalised partial and its
log-sum-exp, merged by `_merge_kernel`. A sliding window W starts each split's walk at the
first key the query sees (seq_len - W); a split wholly before it stays empty.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import validate
from kernels.triton.common import LOG2E, check_runnable, dot_precision, upcast_dots, next_pow2, num_sms

BLOCK_N = 32  # context tokens per inner step
MIN_TOKENS_PER_SPLIT = 256
NO_WINDOW = 1 << 30  # the window passed for full attention: wider than any context


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, table_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr,
    scale_log2, tokens_per_split, window,
    stride_qb, stride_qh, stride_blk, stride_kv, stride_tok, stride_head, stride_table,
    BLOCK_TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)
    start = tl.maximum(start, seq_len - window)  # the query sees the last `window` keys
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    qmask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for tok0 in range(start, end, BLOCK_N):
        t = tok0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        page = tl.load(table_ptr + b * stride_table + t // BLOCK_TOKENS, mask=tmask, other=0).to(tl.int64)
        rows = page * stride_blk + (t % BLOCK_TOKENS) * stride_tok + kvh * stride_head  # [BLOCK_N]
        kvmask = tmask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=kvmask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(cache_ptr + stride_kv + rows[:, None] + d[None, :], mask=kvmask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_N]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: tok0 < end, so column 0 is live
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    live = l > 0  # an empty split (start >= seq_len) has l == 0
    acc = acc / tl.where(live, l, 1.0)[:, None]
    if SPLIT:
        part = ((b * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split).to(tl.int64)  # [GROUP_PAD]
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=qmask)
        tl.store(lse_ptr + part, tl.where(live, m + tl.log2(tl.where(live, l, 1.0)), float("-inf")), mask=g < GROUP)
    else:
        out = out_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, num_heads,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    base = (b * num_heads + h).to(tl.int64) * NUM_SPLITS
    lse = tl.load(lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))  # [SPLITS_PAD]
    w = tl.exp2(lse - tl.max(lse, 0))  # the last token's split is never empty: the max is finite
    mask = (s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    part = tl.load(part_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    acc = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)  # [BLOCK_D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, acc.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Split the context only when (sequence, KV head) programs cannot fill the GPU."""
    programs = batch * num_kv_heads
    target = 2 * num_sms(device)
    if programs >= target:
        return 1
    by_length = triton.cdiv(max_tokens, MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_length, triton.cdiv(target, max(programs, 1)), 64))


def paged_decode_attention(
    query: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float | None = None, *, num_splits: int | None = None, out: torch.Tensor | None = None,
    check_values: bool = True, sliding_window: int | None = None,
) -> torch.Tensor:
    """One new query token per sequence over its paged context; returns `[batch, heads, D]`."""
    dims = validate.check_decode(query, layer_cache, block_tables, seq_lens, scale, num_splits, out, check_values,
                                 sliding_window)
    check_runnable(query)
    batch, num_heads, head_dim = query.shape
    out = torch.empty_like(query) if out is None else out
    if batch == 0:
        return out
    max_tokens = block_tables.shape[1] * dims.layer.block_tokens  # host-side bound: no sync
    splits = num_splits or choose_num_splits(batch, dims.layer.num_kv_heads, max_tokens, query.device)
    tokens_per_split = triton.cdiv(triton.cdiv(max_tokens, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(max_tokens, tokens_per_split)  # drop splits that would start past the table
    part = lse = out  # unused placeholders when not splitting
    if splits > 1:
        part = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=query.device)
    cache = layer_cache
    _decode_kernel[(batch, dims.layer.num_kv_heads, splits)](
        query, cache, block_tables, seq_lens, out, part, lse,
        dims.scale * LOG2E, tokens_per_split, NO_WINDOW if dims.window is None else dims.window,
        query.stride(0), query.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_tables.stride(0),
        BLOCK_TOKENS=dims.layer.block_tokens, GROUP=dims.group, GROUP_PAD=max(16, next_pow2(dims.group)),
        HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_N=BLOCK_N,
        SPLIT=splits > 1, NUM_SPLITS=splits, PRECISION=dot_precision(query.dtype), UPCAST=upcast_dots(query.dtype),
    )
    if splits > 1:
        _merge_kernel[(batch, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), num_heads,
            NUM_SPLITS=splits, SPLITS_PAD=next_pow2(splits), HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        )
    return out
