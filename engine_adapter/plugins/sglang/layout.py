"""SGLang host KV pool pages <-> kvtier blocks. Plain torch; SGLang is not imported here.

A kvtier block is one SGLang page of one shard in kvtier's payload layout
`[num_layers, 2 (K,V), page_size, num_kv_heads, head_dim]` (`kvstore.keys.KV_LAYOUT`),
whatever `--hicache-mem-layout` the pool uses, so pages written by a `layer_first` server
read back into a `page_first` one.

The MHA host pool keeps K and V in one `kv_buffer`; its axes per layout (`p` = page,
`t` = token within the page, `k` = K/V, `l` = layer, `h` = kv head, `d` = head dim):

    layer_first        [2, L, size, H, D]        -> k l p t h d
    page_first         [2, size, L, H, D]        -> k p t l h d
    page_first_direct  [2, pages, L, T, H, D]    -> k p l t h d
    page_head          [2, pages, H, T, L, D]    -> k p h t l d

SGLang's flat data page (`get_data_page(i)` / `set_from_flat_data_page`, the generic path)
is the same with the page axis dropped.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

BUFFER_AXES = {
    "layer_first": "klpthd",
    "page_first": "kptlhd",
    "page_first_direct": "kplthd",
    "page_head": "kphtld",
}
BLOCK_AXES = "plkthd"   # a batch of kvtier blocks: [n, L, 2, T, H, D]


class PageGeometry(NamedTuple):
    layout: str
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        L, two, T, H, D = self.block_shape
        return L * two * T * H * D * self.dtype.itemsize

    def sizes(self, num_pages: int) -> dict[str, int]:
        return {"k": 2, "l": self.num_layers, "p": num_pages, "t": self.page_size,
                "h": self.num_kv_heads, "d": self.head_dim}


def geometry_of(pool) -> PageGeometry:
    """The page geometry of an SGLang MHA host pool (`MHATokenToKVPoolHost`)."""
    layout = getattr(pool, "layout", None)
    if layout not in BUFFER_AXES:
        raise ValueError(f"kvtier's SGLang backend supports --hicache-mem-layout "
                         f"{sorted(BUFFER_AXES)}, not {layout!r}")
    if not hasattr(pool, "head_num") or getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        raise ValueError(f"kvtier's SGLang backend needs an MHA host pool with equal K and V "
                         f"head dims; got {type(pool).__name__} (MLA and hybrid pools are "
                         "not supported yet)")
    return PageGeometry(layout, pool.layer_num, pool.page_size, pool.head_num, pool.head_dim,
                        pool.dtype)


def _perm(src_axes: str, dst_axes: str) -> list[int]:
    return [src_axes.index(a) for a in dst_axes]


class PoolPages:
    """Batched copies between a host pool's `kv_buffer` and kvtier blocks, by page id."""

    def __init__(self, geom: PageGeometry, kv_buffer: torch.Tensor) -> None:
        self.geom, self.axes = geom, BUFFER_AXES[geom.layout]
        num_pages = kv_buffer.numel() // (geom.block_bytes // geom.dtype.itemsize)
        sizes = geom.sizes(num_pages)
        self.view = kv_buffer.view(*[sizes[a] for a in self.axes])  # no copy: same storage
        self.page_dim = self.axes.index("p")
        self.to_blocks = _perm(self.axes, BLOCK_AXES)
        self.from_blocks = _perm(BLOCK_AXES, self.axes)
        page_axes = self.axes.replace("p", "")
        self.page_shape = [sizes[a] for a in page_axes]
        self.page_to_block = _perm(page_axes, BLOCK_AXES[1:])
        self.block_to_page = _perm(BLOCK_AXES[1:], page_axes)

    def page_ids(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Token indices of whole pages (as SGLang hands them over) -> page ids."""
        T = self.geom.page_size
        if host_indices.numel() % T:
            raise ValueError(f"host_indices ({host_indices.numel()}) is not whole pages of {T}")
        return host_indices.reshape(-1, T)[:, 0].to(torch.int64) // T

    def gather(self, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Pages `page_ids` -> `out` [n, L, 2, T, H, D]."""
        pages = self.view.index_select(self.page_dim, page_ids)
        out.copy_(pages.permute(self.to_blocks))

    def scatter(self, page_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """`blocks` [n, L, 2, T, H, D] -> pages `page_ids` of the pool, in place."""
        self.view.index_copy_(self.page_dim, page_ids, blocks.permute(self.from_blocks))

    def flat_page_to_block(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """One flat data page (SGLang's generic path) -> `out` [L, 2, T, H, D]."""
        out.copy_(flat.reshape(self.page_shape).permute(self.page_to_block))

    def block_to_flat_page(self, block: torch.Tensor, out: torch.Tensor) -> None:
        out.view(self.page_shape).copy_(block.permute(self.block_to_page))
