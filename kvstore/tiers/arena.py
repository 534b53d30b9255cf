"""A fixed-slot arena in one torch tensor: the shared body of the GPU and DRAM tiers."""
from __future__ import annotations

from typing import Sequence

import torch

from kvstore.errors import StoreClosedError
from kvstore.events import TierKind
from kvstore.tiers.base import ByteBatch


class ArenaTier:
    """Slots are rows of a `[num_slots, slot_bytes]` uint8 tensor; the free list is a stack."""

    persistent = False

    def __init__(self, kind: TierKind, arena: torch.Tensor) -> None:
        assert arena.dtype == torch.uint8 and arena.dim() == 2 and arena.is_contiguous()
        self.kind = kind
        self.arena = arena  # [num_slots, slot_bytes]
        self.num_slots, self.slot_bytes = arena.shape
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() yields slot 0 first
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.kind.name} tier is closed")

    def num_free(self) -> int:
        return len(self._free)

    def alloc_n(self, n: int) -> list[int] | None:
        self._check_open()
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def free_n(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        self._free.extend(slots)

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(slots, dtype=torch.long, device=self.arena.device)

    def write_n(self, slots: Sequence[int], hashes: Sequence[bytes], srcs: ByteBatch) -> None:
        self._check_open()
        if isinstance(srcs, torch.Tensor):
            # srcs: [n, slot_bytes] -> one indexed copy for the whole batch
            self.arena.index_copy_(0, self._index(slots), srcs.to(self.arena.device, non_blocking=True))
            return
        for slot, src in zip(slots, srcs):
            self.arena[slot].copy_(src, non_blocking=True)
        self._sync()

    def read_n(self, slots: Sequence[int], hashes: Sequence[bytes], dsts: ByteBatch) -> list[bool]:
        self._check_open()
        if isinstance(dsts, torch.Tensor) and dsts.device == self.arena.device:
            torch.index_select(self.arena, 0, self._index(slots), out=dsts)  # dsts: [n, slot_bytes]
        else:
            for slot, dst in zip(slots, dsts):
                dst.copy_(self.arena[slot], non_blocking=True)
            self._sync()
        return [True] * len(slots)

    def _sync(self) -> None:
        if self.arena.device.type == "cuda":
            torch.cuda.current_stream(self.arena.device).synchronize()

    def recover(self) -> list[tuple[bytes, int]]:
        return []

    def slot_view(self, slot: int) -> torch.Tensor:
        """The slot's bytes in place (zero copy); valid while the caller holds a lease."""
        return self.arena[slot]

    def close(self) -> None:
        self._closed = True
        self._free = []
