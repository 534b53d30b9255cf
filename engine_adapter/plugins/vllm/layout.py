"""vLLM's paged KV layouts seen as kvtier blocks, with vectorised block copies.

kvtier's block is `[L, 2, bt, Hkv, D]`. vLLM keeps one tensor per attention layer; the
layouts handled here, all viewed (no copy) as `[num_blocks, 2, bt, Hkv, D]`:
- `[2, nb, bt, H, D]` (K/V first, token-major: vLLM <= 0.32 flash-style and CPU backends)
- `[2, nb, H, bt, D]` (K/V first, head-major)
- `[nb, H, bt, 2*D]` read the way vLLM 0.33's CPU backend reads it: per block and head,
  bt rows of K then bt rows of V (its `view(nb, H, 2*bt, D).chunk(2, dim=2)`).
"""
from __future__ import annotations

import re
from typing import Sequence

import torch


class LayoutError(ValueError):
    """A KV cache tensor whose layout kvtier cannot map onto its blocks."""


def block_view(kv: torch.Tensor, block_tokens: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A `[num_blocks, 2, bt, Hkv, D]` view of one layer's paged KV cache (shares memory)."""
    bt, H, D = block_tokens, num_kv_heads, head_dim
    shape = tuple(kv.shape)
    if kv.dim() == 5 and shape[0] == 2:
        token_major, head_major = shape[2:] == (bt, H, D), shape[2:] == (H, bt, D)
        if token_major and not head_major:
            return kv.permute(1, 0, 2, 3, 4)                      # [nb, 2, bt, H, D]
        if head_major and not token_major:
            return kv.permute(1, 0, 3, 2, 4)                      # [nb, 2, H, bt, D] -> [nb, 2, bt, H, D]
    if kv.dim() == 4 and shape[1:] == (H, bt, 2 * D) and kv.is_contiguous():
        nb = shape[0]
        return kv.view(nb, H, 2, bt, D).permute(0, 2, 3, 1, 4)    # [nb, 2, bt, H, D]
    raise LayoutError(f"KV cache layer of shape {shape} does not match any known vLLM layout for "
                      f"block_size={bt}, num_kv_heads={H}, head_dim={D} (an ambiguous shape also "
                      "lands here when block_size == num_kv_heads: pick another block_size)")


def gather_blocks(views: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[i, l] = views[l][block_ids[i]]; out is `[n, L, 2, bt, H, D]`."""
    for layer, view in enumerate(views):
        out[:, layer] = view[block_ids].to(out.device)


def gather_layer(view: torch.Tensor, layer: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    out[:, layer] = view[block_ids].to(out.device)


def scatter_blocks(src: torch.Tensor, views: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    """views[l][block_ids[i]] = src[i, l] for every layer (one index_put per layer)."""
    for layer, view in enumerate(views):
        view[block_ids.to(view.device)] = src[:, layer].to(view.device, view.dtype)


def layer_order(names: Sequence[str]) -> list[str]:
    """Attention layer names in model order ('model.layers.10.attn' after '...9.attn')."""
    def index(name: str) -> tuple[int, str]:
        found = re.findall(r"\.(\d+)\.", f".{name}.")
        return (int(found[-1]) if found else -1, name)
    return sorted(names, key=index)
