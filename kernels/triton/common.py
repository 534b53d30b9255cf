"""Launcher helpers shared by the Triton kernels."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import triton_interpreting
from kernels.errors import KernelDeviceError

# Decided when the kernels are defined: Triton itself picks the interpreter at @jit time.
INTERPRETING = triton_interpreting()


def check_runnable(t: torch.Tensor) -> None:
    """Triton runs on CUDA tensors, or on CPU tensors only under TRITON_INTERPRET=1."""
    if t.device.type == "cuda" or (INTERPRETING and t.device.type == "cpu"):
        return
    raise KernelDeviceError(
        f"the triton backend cannot run on {t.device} tensors"
        + ("" if INTERPRETING else " (CPU tensors need TRITON_INTERPRET=1 set before importing kernels)")
    )


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use full-precision dots (no TF32) so fp32 matches the reference tightly."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Triton 3.7.1's interpreter computes bf16 tl.dot wrongly (garbage magnitudes); there,
    bf16 operands are widened to fp32 before each dot. Compiled kernels use bf16 dots."""
    return INTERPRETING and dtype == torch.bfloat16


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a small fake machine so split-K heuristics still get exercised


LOG2E = 1.4426950408889634

__all__ = ["tl", "triton", "check_runnable", "next_pow2", "dot_precision", "upcast_dots", "num_sms", "LOG2E", "INTERPRETING"]
