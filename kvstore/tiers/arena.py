"""A fixed-slot arena in one array: the shared body of the GPU and DRAM tiers (a numpy
array in host memory, a torch tensor on a device)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvstore.buffers import cpu_array, tensor_type
from kvstore.errors import StoreClosedError
from kvstore.events import TierKind
from kvstore.tiers.base import ByteBatch, FreeSlots
from transfer.copy import copy_bytes, loaded_torch


class ArenaTier:
    """Slots are rows of a `[num_slots, slot_bytes]` uint8 array (numpy in host memory, a
    torch tensor on a device); the free list is a stack."""

    persistent = False

    def __init__(self, kind: TierKind, arena) -> None:
        if isinstance(arena, np.ndarray):
            assert arena.dtype == np.uint8 and arena.ndim == 2 and arena.flags.c_contiguous
        else:
            assert arena.dim() == 2 and arena.is_contiguous() and arena.element_size() == 1
        self.kind = kind
        self.arena = arena  # [num_slots, slot_bytes]
        # its rows as numpy where it lives in host memory: the copies go through numpy
        # anyway, and a numpy row costs ~0.2 us against ~1.5 us for a torch slice and its
        # .numpy() (two of each were ~5 us of a ~30 us in-process DRAM put)
        self._host = cpu_array(arena)
        self.num_slots, self.slot_bytes = arena.shape
        self._free = FreeSlots(self.num_slots)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.kind.name} tier is closed")

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc_n(self, n: int) -> list[int] | None:
        self._check_open()
        return self._free.take(n)

    def free_n(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        self._free.give_back(slots)

    def persist_frees(self) -> None:
        pass  # nothing of a memory tier outlives the process

    def publish_n(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        pass  # only the DRAM tier tells other processes which block each slot holds

    def write_n(self, slots: Sequence[int], hashes: Sequence[bytes], srcs: ByteBatch) -> None:
        self._check_open()
        host, src = self._host, cpu_array(srcs)
        if host is not None and src is not None:
            for slot, i, n in _runs(slots):  # (into slots: nothing reads them here soon)
                copy_bytes(host[slot:slot + n], src[i:i + n], cold=True)
            return
        for slot, i, n in _runs(slots):
            if isinstance(srcs, (np.ndarray, tensor_type())):
                copy_bytes(self.arena[slot:slot + n], srcs[i:i + n])
            else:
                for k in range(n):
                    copy_bytes(self.arena[slot + k], srcs[i + k])
        self._sync()

    def read_n(self, slots: Sequence[int], hashes: Sequence[bytes], dsts: ByteBatch) -> list[bool]:
        self._check_open()
        host, dst = self._host, cpu_array(dsts)
        if host is not None and dst is not None:
            for slot, i, n in _runs(slots):
                copy_bytes(dst[i:i + n], host[slot:slot + n])
            return [True] * len(slots)
        for slot, i, n in _runs(slots):
            if isinstance(dsts, (np.ndarray, tensor_type())):
                copy_bytes(dsts[i:i + n], self.arena[slot:slot + n])
            else:
                for k in range(n):
                    copy_bytes(dsts[i + k], self.arena[slot + k])
        self._sync()
        return [True] * len(slots)

    def _sync(self) -> None:
        if not isinstance(self.arena, np.ndarray) and self.arena.device.type == "cuda":
            loaded_torch().cuda.current_stream(self.arena.device).synchronize()

    def recover(self) -> list[tuple[bytes, int]]:
        return []

    def slot_view(self, slot: int):
        """The slot's bytes in place (zero copy); valid while the caller holds a lease."""
        return self.arena[slot]

    def close(self) -> None:
        self._closed = True
        self._host = None  # (before an owner unmaps the memory under it)
        self._free.clear()


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first slot, first batch index, length) of each run of consecutive slots, so a batch
    moves in as few slice copies as its slot layout allows (an indexed copy is ~10x slower)."""
    runs = []
    for i, slot in enumerate(slots):
        if runs and slot == runs[-1][0] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([slot, i, 1])
    return [tuple(r) for r in runs]
