"""DRAM tier: a fixed-slot arena in anonymous shared memory (a memfd, `transfer.shm`).

The segment starts with one 4 KiB page describing it, then the slots (the layout its
clients share: `kvstore.arena_layout`). It has no name anywhere: another process reaches it only
when the store's owner hands it a descriptor (`share_fds`, sent over a Unix-domain socket
by the daemon to an authenticated client of this namespace), and then copies slots with no
socket in between. The arena is pre-faulted at creation (first-touch faults on shared
memory cost ~10x a warm copy) and, where the process uses a GPU, registered with CUDA as
pinned memory so device copies run at full speed. Nothing outlives the last process mapping it.
"""
from __future__ import annotations

import os
import secrets

import numpy as np

from kvstore.arena_layout import ARENA_ID_BYTES, META_BYTES, write_meta
from kvstore.events import TierKind
from kvstore.slotdir import SlotDirectory
from kvstore.tiers.arena import ArenaTier
from transfer.copy import loaded_torch
from transfer.shm import ShmSegment


class DramTier(ArenaTier):
    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self._seg = ShmSegment.anonymous(META_BYTES + num_slots * slot_bytes, "kvtier-arena")
        self.arena_id = secrets.token_bytes(ARENA_ID_BYTES)
        write_meta(self._seg._mm, num_slots, slot_bytes, self.arena_id)
        arena = np.frombuffer(self._seg._mm, np.uint8)[META_BYTES:]
        super().__init__(TierKind.DRAM, arena.reshape(num_slots, slot_bytes))
        try:
            self.directory = SlotDirectory(num_slots)
        except BaseException:  # out of descriptors, say: the arena goes too
            self.arena = self._host = None
            self._seg.close()
            raise
        self._pinned = _cuda_pin(self.arena)

    def share_fds(self) -> tuple[int, int]:
        """(arena, slot directory) descriptors for a same-host client of this namespace:
        the arena read-write (it writes the slots the store reserves for its puts), the
        directory read-only. The caller sends and then closes them."""
        arena = self._seg.share_fd(writable=True)
        try:
            return arena, self.directory.share_fd()
        except BaseException:
            os.close(arena)
            raise

    def publish_n(self, slots, hashes) -> None:
        self.directory.publish(slots, hashes)

    def free_n(self, slots, hashes) -> None:
        self.directory.unpublish(slots, hashes)  # before any slot can be handed out again
        super().free_n(slots, hashes)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self.directory.close()
        if self._pinned:
            loaded_torch().cuda.cudart().cudaHostUnregister(self.arena.ctypes.data)
        self.arena = np.empty((0, self.slot_bytes), np.uint8)
        self._seg.close()


def _cuda_pin(arena: np.ndarray) -> bool:
    """Register the arena with CUDA as pinned memory where this process uses a GPU (it
    imported torch: a GPU tier, an engine); a daemon with host tiers only never loads
    torch for it."""
    torch = loaded_torch()
    if torch is None or arena.size == 0 or not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(arena.ctypes.data, arena.size, 0)
    return int(err) == 0
