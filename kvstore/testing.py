"""Fault injection for tests of kvtier and of the engines built on it (never used by the
library itself): damage what a tier holds on disk, the way a bad sector or a stray write
would, to check that the damage comes back as a miss and never as wrong KV."""
from __future__ import annotations

from kvstore.events import TierKind


def flip_ssd_byte(store, block_hash: bytes, offset: int = 5) -> None:
    """Flip one bit of byte `offset` of a block's payload in the SSD tier's slab file.
    `store`: a TieredStore with an SSD tier holding the block (or the SsdTier itself)."""
    tier = store.tier(TierKind.SSD) if hasattr(store, "tier") else store
    where = tier.locate(block_hash)
    if where is None:
        raise KeyError(f"block {bytes(block_hash).hex()} is not on the SSD tier")
    path, start = where
    with open(path, "r+b") as f:
        f.seek(start + offset)
        byte = f.read(1)
        f.seek(start + offset)
        f.write(bytes([byte[0] ^ 0x10]))
