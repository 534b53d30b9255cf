"""Plain-torch reference of every kernel op: the oracle for the Triton kernels and the
production path on CPU machines. Vectorised over the batch (no per-block Python loops).

Shapes (see `kernels/__init__.py` for the contract):
    layer_cache   [num_blocks, 2, block_tokens, num_kv_heads, head_dim]  (kv_cache[:, layer])
    kv_cache      [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]
    block_tables  [batch, max_blocks_per_seq]  int32/int64, entries past a context are ignored
    seq_lens      [batch]  tokens in each context (cached prefix + new tokens)
Attention math runs in float32 and is cast back to the query dtype.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from kernels import validate
from kernels.codec import decode_blocks, encode_blocks  # noqa: F401 (the codec ops' reference)

NAME = "ref"

# Reused scratch for the dense K/V gathers. Fresh multi-MiB CPU allocations are paid in
# page faults on every call (first touch runs at ~1 GB/s here, a warm copy at 10+), which
# made the gathers several times slower than the attention math. Per thread, grow-only.
_scratch = threading.local()


def _workspace(slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A reusable uninitialised buffer of `shape`; valid until the next call with `slot`."""
    numel = 1
    for n in shape:
        numel *= n
    # inference tensors can't be updated outside inference mode (and the engine runs in it)
    key = (slot, like.dtype, like.device, torch.is_inference_mode_enabled())
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel].view(shape)


def write_kv_to_cache(
    key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, check_values: bool = True,
) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_dim]` into their slots (in place).

    slot = block_id * block_tokens + offset; a slot of -1 writes nothing (padding).
    """
    dims = validate.check_write_kv(key, value, layer_cache, slot_mapping, check_values)
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep].to(torch.int64)  # [n]
    blocks, offsets = slots // dims.block_tokens, slots % dims.block_tokens
    layer_cache[blocks, 0, offsets] = key[keep]  # [n, num_kv_heads, head_dim]
    layer_cache[blocks, 1, offsets] = value[keep]


def gather_dense(
    layer_cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `num_tokens` positions of every sequence, `[kv_heads, batch, T, D]`.

    Heads lead so that a sequence's query heads can attend as rows of one fused attention
    call (see paged_decode_attention). T is num_tokens rounded up to whole blocks; positions
    past a sequence's length hold whatever its (clamped) table entries point at, so callers
    mask them.
    """
    num_blocks, _, block_tokens, num_kv_heads, head_dim = layer_cache.shape
    batch = block_tables.shape[0]
    used = max(1, -(-num_tokens // block_tokens))
    ids = block_tables[:, :used].clamp(0, num_blocks - 1).reshape(-1)  # [batch * used]
    # one row per block: a 2-D index_select is a plain row copy. (An index_select over a
    # head-major permuted view would be one copy, but measured up to 100x slower here.)
    flat = layer_cache.reshape(num_blocks, -1)  # [num_blocks, 2*bt*Hkv*D], a view
    rows = _workspace("rows", (ids.shape[0], flat.shape[1]), flat)
    torch.index_select(flat, 0, ids, out=rows)  # [batch * used, 2*bt*Hkv*D]
    kv = rows.view(batch, used, 2, block_tokens, num_kv_heads, head_dim)
    dense = _workspace("dense", (2, num_kv_heads, batch, used, block_tokens, head_dim), flat)
    dense.copy_(kv.permute(2, 4, 0, 1, 3, 5))  # [2, Hkv, B, used, bt, D]
    dense = dense.view(2, num_kv_heads, batch, used * block_tokens, head_dim)
    return dense[0], dense[1]  # each [Hkv, B, T, D], contiguous; scratch, read before the next call


def paged_decode_attention(
    query: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float | None = None, *, num_splits: int | None = 1, out: torch.Tensor | None = None,
    check_values: bool = True, sliding_window: int | None = None,
) -> torch.Tensor:
    """One new query token per sequence over its paged context; returns `[batch, heads, D]`.

    `num_splits` > 1 computes the same result split-K style (partial softmax per chunk of
    the context, then a log-sum-exp merge) — the reference for the flash-decoding kernel.
    None means 1 here. `sliding_window` W: the query (at position seq_len - 1) sees only the
    last W keys, itself included.
    """
    dims = validate.check_decode(query, layer_cache, block_tables, seq_lens, scale, num_splits, out, check_values,
                                 sliding_window)
    batch, num_heads, head_dim = query.shape
    hkv, g = dims.layer.num_kv_heads, dims.group
    k, v = gather_dense(layer_cache, block_tables, int(seq_lens.max()) if batch else 1)  # [Hkv, B, T, D]
    # a sequence's G query heads play the role of G query rows over its own K/V
    q = query.view(batch, hkv, g, head_dim).transpose(0, 1).float()  # [Hkv, B, G, D]
    pos = torch.arange(k.shape[2], device=query.device)[None, :]  # [1, T]
    visible = pos < seq_lens[:, None]  # [B, T]
    if dims.window is not None:
        visible &= pos >= seq_lens[:, None] - dims.window
    if (num_splits or 1) == 1:
        result = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=visible[None, :, None, :],
                                                scale=dims.scale)  # [Hkv, B, G, D]
    else:
        scores = (q * dims.scale) @ k.float().transpose(-1, -2)  # [Hkv, B, G, T]
        scores.masked_fill_(~visible[None, :, None, :], float("-inf"))
        result = _split_k_softmax_v(scores, v.float(), num_splits)
    result = result.transpose(0, 1).reshape(batch, num_heads, head_dim).to(query.dtype)
    return result if out is None else out.copy_(result)


def _split_k_softmax_v(scores: torch.Tensor, v: torch.Tensor, num_splits: int) -> torch.Tensor:
    """softmax(scores) @ v computed over `num_splits` chunks of T and merged by log-sum-exp."""
    b, h, g, t = scores.shape
    chunk = -(-t // num_splits)
    pad = chunk * num_splits - t
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    scores = scores.view(b, h, g, num_splits, chunk)  # [B, Hkv, G, S, C]
    v = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(b, h, 1, num_splits, chunk, v.shape[-1])  # [B, Hkv, 1, S, C, D]
    m = scores.amax(-1, keepdim=True)  # [B, Hkv, G, S, 1]
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # empty chunk: keep exp() finite
    p = torch.exp(scores - m)  # [B, Hkv, G, S, C]
    l = p.sum(-1)  # [B, Hkv, G, S]
    acc = (p.unsqueeze(-2) @ v).squeeze(-2) / l.clamp_min(1e-30)[..., None]  # [B, Hkv, G, S, D]
    lse = torch.where(l > 0, m.squeeze(-1) + torch.log(l), torch.full_like(l, float("-inf")))
    weights = torch.softmax(lse, dim=-1)  # [B, Hkv, G, S]
    return (weights[..., None] * acc).sum(-2)  # [B, Hkv, G, D]


def paged_prefill_attention(
    query: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor, scale: float | None = None, *, max_query_len: int | None = None,
    out: torch.Tensor | None = None, check_values: bool = True, sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a packed chunk of new query tokens over each sequence's context.

    query `[total_q, heads, D]` packs sequence b's new tokens at rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1]; they sit at the last q_len positions of its context
    of seq_lens[b] tokens, whose K/V (new tokens included) must already be in the cache.
    Returns `[total_q, heads, D]`. With `sliding_window` W a query at position p sees keys
    in (p - W, p]: W keys, itself included (transformers' sliding-window mask).

    One fused attention call per sequence (torch's SDPA, flash-style on CPU): no padded
    batch, and no `[q_len, context]` score matrix in memory. `max_query_len` is accepted
    for the kernels' common signature; the reference does not need it.
    """
    dims = validate.check_prefill(query, layer_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, check_values,
                                  sliding_window)
    res = query.new_empty(query.shape) if out is None else out
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end > start:
            res[start:end] = _prefill_one(query[start:end], layer_cache, block_tables[b:b + 1], seq_len,
                                          dims.scale, dims.window)
    return res


def _prefill_one(query: torch.Tensor, layer_cache: torch.Tensor, table: torch.Tensor, seq_len: int,
                 scale: float, window: int | None) -> torch.Tensor:
    """One sequence: query `[q_len, H, D]` at the last q_len of its seq_len positions."""
    q_len = query.shape[0]
    if window is not None and window >= seq_len:
        window = None  # every query sees its whole causal context anyway
    k, v = gather_dense(layer_cache, table, seq_len)  # [Hkv, 1, T, D]
    # 4-D on purpose: torch's fused CPU kernel only takes [batch, heads, L, D]; 3-D inputs
    # fall back to the math path, which builds the whole score matrix (~6x slower at 2k)
    k, v = k.transpose(0, 1)[:, :, :seq_len].float(), v.transpose(0, 1)[:, :, :seq_len].float()  # [1, Hkv, S, D]
    q = query.transpose(0, 1)[None].float()  # [1, H, q_len, D]
    if q_len == seq_len and window is None:  # no cached prefix: plain causal
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at position seq_len - q_len + i and sees keys up to there
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]  # [1, S]
        visible = k_pos <= q_pos  # [q_len, S]
        if window is not None:
            visible &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).to(query.dtype)  # [q_len, H, D]


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None,
    *, check_values: bool = True,
) -> torch.Tensor:
    """Copy blocks (all layers) to a staging buffer `[n, num_layers, 2, bt, Hkv, D]`."""
    validate.check_gather(kv_cache, block_ids, out, check_values)
    n = block_ids.shape[0]
    if out is None:
        out = kv_cache.new_empty((n, *kv_cache.shape[1:]))
    torch.index_select(_block_rows(kv_cache), 0, block_ids, out=out.view(n, -1))  # [n, block_numel]
    return out


def scatter_blocks(
    staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, *, check_values: bool = True
) -> None:
    """Copy staging `[n, num_layers, 2, bt, Hkv, D]` into cache blocks `block_ids` (in place)."""
    validate.check_scatter(staging, kv_cache, block_ids, check_values)
    rows = staging.view(block_ids.shape[0], -1)  # [n, block_numel]
    _block_rows(kv_cache).index_copy_(0, block_ids.to(torch.int64), rows)


def _block_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as one row per block, `[num_blocks, block_numel]` (a view: blocks are
    contiguous). Row-wise index_select/index_copy_ are plain memcpys, far faster than 6-D."""
    block_numel = kv_cache[0].numel()
    return kv_cache.as_strided((kv_cache.shape[0], block_numel), (kv_cache.stride(0), 1))
