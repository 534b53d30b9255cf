"""The Tier contract: a fixed-slot store of equal-size blocks.

A tier holds `num_slots` slots of `slot_bytes` each (one namespace's block size), a free
list, and batched copy operations. It knows nothing about LRU, pins or leases: the
`TieredStore` decides which slot holds which block and calls the tier to move bytes.

Threading: `alloc_n`/`free_n`/`publish_n` are called under the store's lock. `write_n`/`read_n`
are called outside it, concurrently, always on slots the caller has reserved, leased or is
moving (a demotion's victims stay readable at their slot until the move commits), so two
calls never write the same slot at once. A persistent tier's `free_n` never raises: what it
could not delete on its storage it must treat as stale at its next open. Two puts of one
hash may each write a slot of the same tier at once (kvstore.tiermap.claim): the one
`publish_n` names becomes the hash's, the other's slot is freed, and a tier that keeps
per-hash state (the SSD tier's index) must let neither undo the other's.

Byte arguments are uint8 arrays (`kvstore.buffers.byte_rows`: numpy in host memory, torch
tensors on a device): either one 2-D array `[n, slot_bytes]` (one indexed copy for the
whole batch) or a sequence of n 1-D arrays of `slot_bytes` each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from kvstore.events import TierKind

if TYPE_CHECKING:
    import torch

ByteBatch = Union[np.ndarray, "torch.Tensor", Sequence[Union[np.ndarray, "torch.Tensor"]]]


@runtime_checkable
class Tier(Protocol):
    kind: TierKind
    num_slots: int
    slot_bytes: int
    persistent: bool  # True when blocks survive close/reopen (and `recover` lists them)

    def num_free(self) -> int:
        """Slots that can be allocated now."""

    def num_used(self) -> int:
        """Slots allocated (holding or reserved for a block): what the watermarks count. Not
        always num_slots - num_free(): a tier whose disk refused to grow has no more free
        slots for now, yet holds no more blocks."""

    def alloc_n(self, n: int) -> list[int] | None:
        """Take n free slots, or None (taking nothing) when fewer than n are free."""

    def free_n(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Return slots to the free list; a persistent tier also deletes their stored values
        (the SSD tier zeroes their headers at once, so no index rebuilt from them brings a
        freed block back; its index entries go with its next write: see
        kvstore.tiers.ssdindex)."""

    def persist_frees(self) -> None:
        """Make the frees so far durable now (an explicit remove must not come back after a
        crash; an eviction may wait for the next write), with any other index writes the
        tier has queued (the SSD tier's: see kvstore.tiers.ssdindex). Called outside the
        store's lock; never raises (what it could not write stays queued). A no-op for
        memory tiers."""

    def publish_n(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        """The blocks in these slots became readable (committed, demoted or promoted there);
        they stay unchanged until `free_n`. Called under the store's lock."""

    def write_n(self, slots: Sequence[int], hashes: Sequence[bytes], srcs: ByteBatch) -> None:
        """Copy one block into each slot. Persistent tiers make it durable before returning."""

    def read_n(self, slots: Sequence[int], hashes: Sequence[bytes], dsts: ByteBatch) -> list[bool]:
        """Copy each slot's block into its destination. False marks a block that failed
        verification (corrupted on disk, unreadable): its destination is left unspecified.
        Only StoreClosedError is raised; an I/O failure is a False (TierIOError at most)."""

    def slot_view(self, slot: int):
        """The slot's bytes as a uint8 array: in place for memory tiers (the source of a
        demotion, read outside the lock while the slot is held), a fresh copy otherwise."""

    def recover(self) -> list[tuple[bytes, int]]:
        """(hash, slot) for every block found at open (persistent tiers only)."""

    def close(self) -> None:
        """Release memory / files. Any later call raises StoreClosedError."""


class FreeSlots:
    """The free list of a tier: a stack of slot ids, so alloc and free are O(1) per slot and
    a fresh tier hands out slots 0, 1, 2... (consecutive slots copy as one run)."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n slots, or None (taking nothing) when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def take_one(self) -> int | None:
        return self._free.pop() if self._free else None

    def give_back(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def clear(self) -> None:
        self._free = []
