"""Triton copies between K/V tokens, the paged cache and a staging buffer.

Cache layout: kv_cache [num_blocks, num_layers, 2, bt, Hkv, D]; layer view
[num_blocks, 2, bt, Hkv, D] with inner dims contiguous (see kernels.cache).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import validate
from kernels.triton.common import check_runnable, next_pow2

COPY_BLOCK = 4096  # elements per program in gather/scatter


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_tok, stride_blk, stride_kv,
    BLOCK_TOKENS: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, ROW_PAD)
        mask = offs < ROW
        src = tok.to(tl.int64) * stride_tok + offs
        dst = (slot // BLOCK_TOKENS) * stride_blk + (slot % BLOCK_TOKENS) * ROW + offs
        tl.store(cache_ptr + dst, tl.load(key_ptr + src, mask=mask), mask=mask)
        tl.store(cache_ptr + stride_kv + dst, tl.load(value_ptr + src, mask=mask), mask=mask)


def write_kv_to_cache(
    key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, check_values: bool = True,
) -> None:
    """Write `key`/`value` `[num_tokens, Hkv, D]` into their slots; -1 = skip (in place)."""
    dims = validate.check_write_kv(key, value, layer_cache, slot_mapping, check_values)
    check_runnable(key)
    if key.shape[0] == 0:
        return
    row = dims.num_kv_heads * dims.head_dim  # one token's K (or V): [Hkv, D] contiguous
    _write_kv_kernel[(key.shape[0],)](
        key, value, layer_cache, slot_mapping,
        key.stride(0), layer_cache.stride(0), layer_cache.stride(1),
        BLOCK_TOKENS=dims.block_tokens, ROW=row, ROW_PAD=next_pow2(row),
    )


@triton.jit
def _block_copy_kernel(
    src_ptr, dst_ptr, ids_ptr, src_stride, dst_stride, block_numel,
    GATHER: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    if GATHER:  # cache block `blk` -> staging row i
        src = blk * src_stride + offs
        dst = i.to(tl.int64) * dst_stride + offs
    else:  # staging row i -> cache block `blk`
        src = i.to(tl.int64) * src_stride + offs
        dst = blk * dst_stride + offs
    tl.store(dst_ptr + dst, tl.load(src_ptr + src, mask=mask), mask=mask)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
    n = ids.shape[0]
    block_numel = math.prod(src.shape[1:])  # one block, all layers: [L, 2, bt, Hkv, D]
    if n == 0 or block_numel == 0:
        return
    grid = (n, triton.cdiv(block_numel, COPY_BLOCK))
    _block_copy_kernel[grid](
        src, dst, ids, src.stride(0), dst.stride(0), block_numel, GATHER=gather, BLOCK=COPY_BLOCK
    )


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None,
    *, check_values: bool = True,
) -> torch.Tensor:
    """Copy blocks (all layers) to a staging buffer `[n, num_layers, 2, bt, Hkv, D]`."""
    validate.check_gather(kv_cache, block_ids, out, check_values)
    check_runnable(kv_cache)
    if out is None:
        out = kv_cache.new_empty((block_ids.shape[0], *kv_cache.shape[1:]))
    _launch_copy(kv_cache, out, block_ids, gather=True)
    return out


def scatter_blocks(
    staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, *, check_values: bool = True
) -> None:
    """Copy staging `[n, num_layers, 2, bt, Hkv, D]` into cache blocks `block_ids` (in place)."""
    validate.check_scatter(staging, kv_cache, block_ids, check_values)
    check_runnable(kv_cache)
    _launch_copy(staging, kv_cache, block_ids, gather=False)
