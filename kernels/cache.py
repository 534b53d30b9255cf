"""The paged KV cache: its layout and a helper to allocate one.

Layout (one tensor for all layers, block-major):

    kv_cache: [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]

Why block-major: `kv_cache[b]` is exactly the store's block payload
`[num_layers, 2, block_tokens, num_kv_heads, head_dim]` and is contiguous, so moving a
batch of blocks to or from a staging buffer is one `index_select` / `index_copy_` (one
contiguous run of `block_bytes` per block). The attention ops take one layer's view,
`kv_cache[:, layer]` -> `[num_blocks, 2, block_tokens, num_kv_heads, head_dim]`: the block
stride is large but every block's K (and V) for one KV head is `block_tokens` rows of
`head_dim` contiguous elements, so decode reads stay coalesced.
"""
from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kv_cache_shape(
    num_blocks: int, num_layers: int, block_tokens: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int, int]:
    """The shape of a paged cache; see the module docstring for the layout."""
    dims = (num_blocks, num_layers, block_tokens, num_kv_heads, head_dim)
    if any(int(x) < 1 for x in dims):
        raise ValueError(f"kv cache dimensions must all be >= 1, got {dims}")
    return (num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim)


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zero-filled paged cache `[num_blocks, num_layers, 2, block_tokens, kv_heads, head_dim]`."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"kv cache dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    shape = kv_cache_shape(num_blocks, num_layers, block_tokens, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer of a paged cache: `[num_blocks, 2, block_tokens, num_kv_heads, head_dim]`."""
    return kv_cache[:, layer]


def block_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block (all layers, K and V): the store's payload size."""
    return kv_cache[0].numel() * kv_cache.element_size()
