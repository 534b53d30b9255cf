"""Paged KV-cache kernels: the bottom layer of kvtier (imports nothing else of kvtier).

Paged cache layout (one tensor for all layers, block-major; see `kernels.cache`):

    kv_cache    [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]
    layer view  kv_cache[:, layer] -> [num_blocks, 2, block_tokens, num_kv_heads, head_dim]

`kv_cache[b]` is the store's block payload `[num_layers, 2, block_tokens, num_kv_heads,
head_dim]`, contiguous, so gather/scatter to a staging buffer is one indexed copy. Index
tensors are int32 or int64; dtypes fp16, bf16 or fp32 (query/key/value match the cache).

Ops (one backend chosen at import by `KVTIER_KERNELS=ref|triton|auto`, see `dispatch`):

    write_kv_to_cache(key, value, layer_cache, slot_mapping)             in place
        key/value [num_tokens, num_kv_heads, head_dim]; slot_mapping [num_tokens],
        slot = block_id * block_tokens + offset, -1 = padding (skipped).
    paged_decode_attention(query, layer_cache, block_tables, seq_lens, scale=None,
                           *, num_splits=None, out=None, sliding_window=None)
                                                                -> [batch, num_heads, head_dim]
        query [batch, num_heads, head_dim], one new token per sequence; block_tables
        [batch, max_blocks]; seq_lens [batch] >= 1 (context incl. the new token, whose K/V
        must already be written); num_splits None = auto split-K, 1 = none.
    paged_prefill_attention(query, layer_cache, block_tables, cu_seqlens_q, seq_lens,
                            scale=None, *, max_query_len=None, out=None, sliding_window=None)
                                                                -> like query
        query [total_q, num_heads, head_dim] packs each sequence's new tokens at rows
        cu_seqlens_q[b]:cu_seqlens_q[b+1]; they are the last q_len of seq_lens[b] context
        tokens (cached prefix + new), causal. Write their K/V first.
    sliding_window W (both attention ops): a query at position p sees only keys in
        (p - W, p], W keys itself included (Mistral / Qwen2); None = the whole context.
    gather_blocks(kv_cache, block_ids, out=None) -> [n, num_layers, 2, bt, Hkv, D]
    scatter_blocks(staging, kv_cache, block_ids)                          in place
    encode_blocks(blocks, codec, out=None) -> uint8 [n, codec_encoded_bytes(block shape)]
        blocks [n, num_layers, 2, bt, Hkv, D] contiguous; codec "int8" or "fp8_e4m3"
        (per token and kv head fp16 scales; layout and rounding in `kernels.codec`)
    decode_blocks(encoded, codec, kv_cache, block_ids)                    in place
        block i of `encoded` dequantized into kv_cache[block_ids[i]]

Every op checks its inputs first and raises a `KernelInputError` (ValueError; the dtype
error is also a TypeError) before any kernel runs. `check_values=False` skips the checks
that read index tensors (one device sync each) for callers that validated the step once.

Usage:

    import torch, kernels
    cache = kernels.allocate_kv_cache(num_blocks=1024, num_layers=2, block_tokens=16,
                                      num_kv_heads=2, head_dim=64, dtype=torch.float16)
    layer0 = kernels.layer_view(cache, 0)
    # prefill 20 tokens of one sequence into blocks 7 and 3 (GQA: 8 query heads, 2 KV heads)
    k, v, q = (torch.randn(20, h, 64, dtype=torch.float16) for h in (2, 2, 8))
    block_tables = torch.tensor([[7, 3]], dtype=torch.int32)
    slots = torch.cat([7 * 16 + torch.arange(16), 3 * 16 + torch.arange(4)])
    kernels.write_kv_to_cache(k, v, layer0, slots)
    o = kernels.paged_prefill_attention(q, layer0, block_tables,   # o: [20, 8, 64]
                                        torch.tensor([0, 20]), torch.tensor([20]))
    # decode token 21: write its K/V to slot 3 * 16 + 4, then attend over 21 tokens
    o1 = kernels.paged_decode_attention(q[:1], layer0, block_tables, torch.tensor([21]))
    # save the full block to the store, load it back later
    staged = kernels.gather_blocks(cache, torch.tensor([7]))      # [1, 2, 2, 16, 2, 64]
    kernels.scatter_blocks(staged, cache, torch.tensor([9]))
"""
from __future__ import annotations

from kernels import dispatch as _dispatch
from kernels.cache import allocate_kv_cache, block_bytes, kv_cache_shape, layer_view
from kernels.codec import CODECS as QUANT_CODECS
from kernels.codec import encoded_bytes as codec_encoded_bytes
from kernels.errors import (
    KernelBackendError,
    KernelDeviceError,
    KernelDTypeError,
    KernelIndexError,
    KernelInputError,
    KernelShapeError,
)

_backend = _dispatch.select_from_environment()

BACKEND: str = _backend.NAME
write_kv_to_cache = _backend.write_kv_to_cache
paged_decode_attention = _backend.paged_decode_attention
paged_prefill_attention = _backend.paged_prefill_attention
gather_blocks = _backend.gather_blocks
scatter_blocks = _backend.scatter_blocks
encode_blocks = _backend.encode_blocks
decode_blocks = _backend.decode_blocks

__all__ = [
    "BACKEND",
    "write_kv_to_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "gather_blocks",
    "scatter_blocks",
    "encode_blocks",
    "decode_blocks",
    "QUANT_CODECS",
    "codec_encoded_bytes",
    "allocate_kv_cache",
    "kv_cache_shape",
    "layer_view",
    "block_bytes",
    "KernelInputError",
    "KernelShapeError",
    "KernelDTypeError",
    "KernelDeviceError",
    "KernelIndexError",
    "KernelBackendError",
]
