"""GPU tier: a fixed-slot arena in device memory.

On a machine without a GPU the same code runs on a CPU tensor (device="cpu"), which is what
the tests exercise; `default_device()` picks CUDA when present.
"""
from __future__ import annotations

import torch

from kvstore.events import TierKind
from kvstore.tiers.arena import ArenaTier


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class GpuTier(ArenaTier):
    def __init__(self, num_slots: int, slot_bytes: int, device: str | None = None) -> None:
        dev = torch.device(device or default_device())
        super().__init__(TierKind.GPU, torch.zeros((num_slots, slot_bytes), dtype=torch.uint8, device=dev))
        self.device = dev

    def close(self) -> None:
        super().close()
        self.arena = torch.empty((0, self.slot_bytes), dtype=torch.uint8)
