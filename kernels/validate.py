"""Input checks shared by every backend: run on the host before any kernel launches.

Shape, dtype, stride and device checks read only metadata. Value checks (block ids in
range, lengths within the block table) read the index tensors, which costs one device sync
on a GPU; launchers take `check_values=False` for callers that validated once per step.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kernels.cache import SUPPORTED_DTYPES
from kernels.errors import (
    KernelDeviceError,
    KernelDTypeError,
    KernelIndexError,
    KernelInputError,
    KernelShapeError,
)

INDEX_DTYPES = (torch.int32, torch.int64)
PAD_SLOT = -1  # a slot_mapping entry that writes nothing (padding tokens)


class LayerDims(NamedTuple):
    num_blocks: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int


def _need(cond: bool, exc: type[Exception], msg: str) -> None:
    if not cond:
        raise exc(msg)


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    _need(isinstance(t, torch.Tensor), KernelDTypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _need(t.dtype in allowed, KernelDTypeError, f"{name} dtype {t.dtype} not in {allowed}")


def _check_rank(name: str, t: torch.Tensor, rank: int, shape_doc: str) -> None:
    _need(t.dim() == rank, KernelShapeError, f"{name} must be {shape_doc}, got shape {tuple(t.shape)}")


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    _need(t.is_contiguous(), KernelShapeError, f"{name} must be contiguous (call .contiguous()), strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise KernelDeviceError(f"tensors are on different devices: {devices}")


def check_layer_cache(layer_cache: torch.Tensor) -> LayerDims:
    """One layer's view `[num_blocks, 2, block_tokens, num_kv_heads, head_dim]`."""
    doc = "[num_blocks, 2, block_tokens, num_kv_heads, head_dim] (kv_cache[:, layer])"
    _check_dtype("kv cache", layer_cache, SUPPORTED_DTYPES)
    _check_rank("layer cache", layer_cache, 5, doc)
    nb, two, bt, h, d = layer_cache.shape
    _need(two == 2, KernelShapeError, f"layer cache dim 1 must be 2 (K, V), got {two}")
    _need(min(nb, bt, h, d) >= 1, KernelShapeError, f"layer cache has an empty dim: {tuple(layer_cache.shape)}")
    inner = (bt * h * d, h * d, d, 1)
    _need(
        tuple(layer_cache.stride()[1:]) == inner,
        KernelShapeError,
        f"layer cache inner dims must be contiguous (strides {inner}), got {layer_cache.stride()[1:]}",
    )
    return LayerDims(nb, bt, h, d)


def check_block_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int) -> None:
    _check_dtype("block_tables", block_tables, INDEX_DTYPES)
    _check_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    _check_rank("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    _check_rank("seq_lens", seq_lens, 1, "[batch]")
    _need(block_tables.shape[0] == batch, KernelShapeError, f"block_tables has {block_tables.shape[0]} rows, batch is {batch}")
    _need(seq_lens.shape[0] == batch, KernelShapeError, f"seq_lens has {seq_lens.shape[0]} entries, batch is {batch}")
    _need(block_tables.stride(-1) == 1, KernelShapeError, "block_tables rows must be contiguous")
    _need(seq_lens.is_contiguous(), KernelShapeError, "seq_lens must be contiguous")


def check_block_table_values(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, dims: LayerDims, min_len: int
) -> None:
    """Lengths in [min_len, max_blocks * block_tokens]; used block ids in [0, num_blocks)."""
    if seq_lens.numel() == 0:
        return
    max_tokens = block_tables.shape[1] * dims.block_tokens
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    _need(lo >= min_len, KernelIndexError, f"seq_lens must be >= {min_len}, got min {lo}")
    _need(
        hi <= max_tokens,
        KernelIndexError,
        f"a context of {hi} tokens needs {math.ceil(hi / dims.block_tokens)} blocks but block_tables "
        f"holds {block_tables.shape[1]} per sequence ({max_tokens} tokens)",
    )
    used_blocks = (seq_lens.to(torch.int64) + dims.block_tokens - 1) // dims.block_tokens  # [batch]
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)  # [max_blocks]
    used = cols[None, :] < used_blocks[:, None]  # [batch, max_blocks]
    bad = used & ((block_tables < 0) | (block_tables >= dims.num_blocks))
    if bool(bad.any()):
        seq, col = (int(x) for x in bad.nonzero()[0])
        raise KernelIndexError(
            f"block_tables[{seq}, {col}] = {int(block_tables[seq, col])} is out of range "
            f"[0, {dims.num_blocks}) and is used by a context of {int(seq_lens[seq])} tokens"
        )


def check_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    _need(math.isfinite(scale) and scale > 0, KernelInputError, f"scale must be a finite positive float, got {scale}")
    return float(scale)


def check_heads(num_heads: int, num_kv_heads: int) -> int:
    """The GQA group size (query heads per KV head)."""
    _need(
        num_heads % num_kv_heads == 0,
        KernelShapeError,
        f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})",
    )
    return num_heads // num_kv_heads


def check_query(name: str, query: torch.Tensor, cache: torch.Tensor, dims: LayerDims) -> int:
    """`[tokens_or_batch, num_heads, head_dim]`, the cache's dtype; returns the group size."""
    _check_dtype(name, query, SUPPORTED_DTYPES)
    _check_rank(name, query, 3, "[tokens, num_heads, head_dim]")
    _need(query.dtype == cache.dtype, KernelDTypeError, f"{name} dtype {query.dtype} != kv cache dtype {cache.dtype}")
    _need(query.shape[2] == dims.head_dim, KernelShapeError, f"{name} head_dim {query.shape[2]} != cache head_dim {dims.head_dim}")
    _check_contiguous(name, query)
    return check_heads(query.shape[1], dims.num_kv_heads)


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> None:
    if out is None:
        return
    _need(out.shape == like.shape, KernelShapeError, f"out shape {tuple(out.shape)} != {tuple(like.shape)}")
    _need(out.dtype == like.dtype, KernelDTypeError, f"out dtype {out.dtype} != {like.dtype}")
    _check_contiguous("out", out)
    check_same_device(out=out, like=like)


# ---- one check per op: each returns what its launchers need -------------------------------


class AttnDims(NamedTuple):
    layer: LayerDims
    group: int  # query heads per KV head
    scale: float
    window: int | None = None  # sliding window: a query sees this many keys, itself included


def check_window(sliding_window: int | None) -> int | None:
    _need(sliding_window is None or (isinstance(sliding_window, int) and not isinstance(sliding_window, bool)
                                     and sliding_window >= 1), KernelInputError,
          f"sliding_window must be None (full attention) or an int >= 1, got {sliding_window!r}")
    return sliding_window


def check_write_kv(
    key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor,
    check_values: bool = True,
) -> LayerDims:
    dims = check_layer_cache(layer_cache)
    for name, t in (("key", key), ("value", value)):
        _check_dtype(name, t, SUPPORTED_DTYPES)
        _check_rank(name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        _need(t.dtype == layer_cache.dtype, KernelDTypeError, f"{name} dtype {t.dtype} != kv cache dtype {layer_cache.dtype}")
        _need(tuple(t.shape[1:]) == (dims.num_kv_heads, dims.head_dim), KernelShapeError,
              f"{name} must be [num_tokens, {dims.num_kv_heads}, {dims.head_dim}], got {tuple(t.shape)}")
        _check_contiguous(name, t)
    _need(key.shape == value.shape, KernelShapeError, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    _check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    _need(tuple(slot_mapping.shape) == (key.shape[0],), KernelShapeError,
          f"slot_mapping must be [{key.shape[0]}] (one slot per token), got {tuple(slot_mapping.shape)}")
    _check_contiguous("slot_mapping", slot_mapping)
    check_same_device(key=key, value=value, kv_cache=layer_cache, slot_mapping=slot_mapping)
    if check_values and slot_mapping.numel():
        num_slots = dims.num_blocks * dims.block_tokens
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        _need(lo >= PAD_SLOT, KernelIndexError, f"slot_mapping has {lo}; slots are >= 0, or {PAD_SLOT} for padding")
        _need(hi < num_slots, KernelIndexError, f"slot_mapping has {hi}; the cache has {num_slots} slots")
    return dims


def check_decode(
    query: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float | None, num_splits: int | None, out: torch.Tensor | None, check_values: bool = True,
    sliding_window: int | None = None,
) -> AttnDims:
    dims = check_layer_cache(layer_cache)
    group = check_query("query", query, layer_cache, dims)
    check_block_table(block_tables, seq_lens, query.shape[0])
    _need(num_splits is None or (isinstance(num_splits, int) and num_splits >= 1), KernelInputError,
          f"num_splits must be None (auto) or an int >= 1, got {num_splits!r}")
    check_same_device(query=query, kv_cache=layer_cache, block_tables=block_tables, seq_lens=seq_lens)
    check_out(out, query)
    if check_values:
        check_block_table_values(block_tables, seq_lens, dims, min_len=1)
    return AttnDims(dims, group, check_scale(scale, dims.head_dim), check_window(sliding_window))


def check_prefill(
    query: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor, scale: float | None, out: torch.Tensor | None, check_values: bool = True,
    sliding_window: int | None = None,
) -> AttnDims:
    dims = check_layer_cache(layer_cache)
    group = check_query("query", query, layer_cache, dims)
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_block_table(block_tables, seq_lens, batch)
    _check_dtype("cu_seqlens_q", cu_seqlens_q, INDEX_DTYPES)
    _need(tuple(cu_seqlens_q.shape) == (batch + 1,), KernelShapeError,
          f"cu_seqlens_q must be [batch + 1] = [{batch + 1}], got {tuple(cu_seqlens_q.shape)}")
    _check_contiguous("cu_seqlens_q", cu_seqlens_q)
    check_same_device(query=query, kv_cache=layer_cache, block_tables=block_tables,
                      cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    check_out(out, query)
    if check_values:
        _check_cu_seqlens(cu_seqlens_q, seq_lens, query.shape[0])
        check_block_table_values(block_tables, seq_lens, dims, min_len=0)
    return AttnDims(dims, group, check_scale(scale, dims.head_dim), check_window(sliding_window))


def _check_cu_seqlens(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> None:
    first, last = int(cu_seqlens_q[0]), int(cu_seqlens_q[-1])
    _need(first == 0 and last == num_tokens, KernelIndexError,
          f"cu_seqlens_q must start at 0 and end at the number of query tokens {num_tokens}, got {first}..{last}")
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [batch]
    _need(bool((q_lens >= 0).all()), KernelIndexError, "cu_seqlens_q must be non-decreasing")
    too_long = q_lens > seq_lens
    if bool(too_long.any()):
        seq = int(too_long.nonzero()[0, 0])
        raise KernelIndexError(
            f"sequence {seq} has {int(q_lens[seq])} new query tokens but seq_lens[{seq}] = {int(seq_lens[seq])}; "
            "seq_lens counts the cached prefix plus the new tokens"
        )


def check_gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None,
                 check_values: bool = True) -> None:
    _check_cache_and_ids(kv_cache, block_ids, check_values)
    if out is not None:
        expect = (block_ids.shape[0], *kv_cache.shape[1:])
        _need(tuple(out.shape) == expect, KernelShapeError, f"staging buffer must be {expect}, got {tuple(out.shape)}")
        _need(out.dtype == kv_cache.dtype, KernelDTypeError, f"staging dtype {out.dtype} != kv cache dtype {kv_cache.dtype}")
        _check_contiguous("staging buffer", out)
        check_same_device(kv_cache=kv_cache, staging=out)


def check_scatter(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                  check_values: bool = True) -> None:
    _check_cache_and_ids(kv_cache, block_ids, check_values)
    _check_dtype("staging buffer", staging, SUPPORTED_DTYPES)
    expect = (block_ids.shape[0], *kv_cache.shape[1:])
    _need(tuple(staging.shape) == expect, KernelShapeError, f"staging buffer must be {expect}, got {tuple(staging.shape)}")
    _need(staging.dtype == kv_cache.dtype, KernelDTypeError, f"staging dtype {staging.dtype} != kv cache dtype {kv_cache.dtype}")
    _check_contiguous("staging buffer", staging)
    check_same_device(kv_cache=kv_cache, staging=staging)
    if check_values and block_ids.numel() > 1:
        _need(torch.unique(block_ids).numel() == block_ids.numel(), KernelIndexError,
              "scatter_blocks block_ids must be distinct (two blocks cannot land in one slot)")


def _check_cache_and_ids(kv_cache: torch.Tensor, block_ids: torch.Tensor, check_values: bool) -> None:
    _check_dtype("kv cache", kv_cache, SUPPORTED_DTYPES)
    _check_rank("kv cache", kv_cache, 6, "[num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]")
    _need(kv_cache.shape[2] == 2, KernelShapeError, f"kv cache dim 2 must be 2 (K, V), got {kv_cache.shape[2]}")
    _need(kv_cache[0].is_contiguous(), KernelShapeError, "each block of the kv cache must be contiguous")
    _check_dtype("block_ids", block_ids, INDEX_DTYPES)
    _check_rank("block_ids", block_ids, 1, "[num_blocks_to_copy]")
    _check_contiguous("block_ids", block_ids)
    check_same_device(kv_cache=kv_cache, block_ids=block_ids)
    if check_values and block_ids.numel():
        lo, hi = int(block_ids.min()), int(block_ids.max())
        _need(lo >= 0 and hi < kv_cache.shape[0], KernelIndexError,
              f"block_ids must be in [0, {kv_cache.shape[0]}), got min {lo} max {hi}")
