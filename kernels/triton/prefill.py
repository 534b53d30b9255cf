"""Triton paged prefill attention: a packed chunk of new query tokens per sequence, causal,
over the sequence's paged context (cached prefix + the new tokens, already written).

One program per (query tile of one sequence, query head). Query row i of sequence b sits
at absolute position seq_len - q_len + i and sees keys [0, that position], or with a
sliding window W only (position - W, position]. Keys are walked BLOCK_N at a time through
the block table, from the first key the tile's first row sees, with an online softmax in
base 2. Row r of a tile first sees key lo + r at the latest (lo: row 0's first key), inside
the first step since BLOCK_N >= BLOCK_M, so a real row's running max is finite from then on;
a padding row past q_len may see no key at all, and its max is kept finite so that its
(never stored) exponentials stay quiet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import validate
from kernels.triton.common import LOG2E, check_runnable, dot_precision, upcast_dots, next_pow2
from kernels.triton.decode import NO_WINDOW

BLOCK_M = 32  # query rows per program
BLOCK_N = 32  # context tokens per inner step (>= BLOCK_M: see the module docstring)


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, table_ptr, cu_ptr, seq_lens_ptr, out_ptr, scale_log2, window,
    stride_qt, stride_qh, stride_blk, stride_kv, stride_tok, stride_head, stride_table,
    BLOCK_TOKENS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q_pos = seq_len - q_len + i  # [BLOCK_M] absolute positions
        qmask = (i < q_len)[:, None] & (d < HEAD_DIM)[None, :]
        rows_q = (q_start + i).to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :]
        q = tl.load(q_ptr + rows_q, mask=qmask, other=0.0)  # [BLOCK_M, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kvh = h // GROUP
        end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)  # last row's keys
        lo = tl.maximum(0, seq_len - q_len + tile * BLOCK_M - window + 1)  # first row's first key
        for tok0 in range(lo, end, BLOCK_N):
            t = tok0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            page = tl.load(table_ptr + b * stride_table + t // BLOCK_TOKENS, mask=tmask, other=0).to(tl.int64)
            rows = page * stride_blk + (t % BLOCK_TOKENS) * stride_tok + kvh * stride_head  # [BLOCK_N]
            kvmask = tmask[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(cache_ptr + stride_kv + rows[:, None] + d[None, :], mask=kvmask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
            seen = tmask[None, :] & (t[None, :] <= q_pos[:, None]) & (t[None, :] > q_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row that sees nothing
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        acc = acc / tl.where(l > 0, l, 1.0)[:, None]  # l == 0 only on padding rows
        tl.store(out_ptr + rows_q, acc.to(out_ptr.dtype.element_ty), mask=qmask)


def paged_prefill_attention(
    query: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor, scale: float | None = None, *, max_query_len: int | None = None,
    out: torch.Tensor | None = None, check_values: bool = True, sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new query tokens over their paged contexts (like query).

    `max_query_len` (the longest chunk) sizes the grid; None reads it from cu_seqlens_q
    (one device sync).
    """
    dims = validate.check_prefill(query, layer_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, check_values,
                                  sliding_window)
    check_runnable(query)
    total_q, num_heads, head_dim = query.shape
    batch = seq_lens.shape[0]
    out = torch.empty_like(query) if out is None else out
    if total_q == 0 or batch == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    cache = layer_cache
    grid = (triton.cdiv(max(max_query_len, 1), BLOCK_M), batch, num_heads)
    _prefill_kernel[grid](
        query, cache, block_tables, cu_seqlens_q, seq_lens, out, dims.scale * LOG2E,
        NO_WINDOW if dims.window is None else dims.window,
        query.stride(0), query.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_tables.stride(0),
        BLOCK_TOKENS=dims.layer.block_tokens, GROUP=dims.group, HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PRECISION=dot_precision(query.dtype), UPCAST=upcast_dots(query.dtype),
    )
    return out
