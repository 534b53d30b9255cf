"""Which backend runs the kernel ops: chosen once, at import of `kernels`.

`KVTIER_KERNELS` (the only environment variable the kernels read, with Triton's own
`TRITON_INTERPRET`):
    ref     the torch reference (`kernels.ref`) on any device
    triton  the Triton kernels (`kernels.triton`); needs CUDA, or TRITON_INTERPRET=1 to run
            them on CPU tensors through Triton's interpreter (tests only: ~370x slower)
    auto    (default) triton when a CUDA device is present and triton imports, else ref
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

from kernels.errors import KernelBackendError

ENV_VAR = "KVTIER_KERNELS"
CHOICES = ("ref", "triton", "auto")
OPS = ("write_kv_to_cache", "paged_decode_attention", "paged_prefill_attention", "gather_blocks", "scatter_blocks",
       "encode_blocks", "decode_blocks")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def resolve(requested: str, cuda_available: bool, triton_available: bool, interpreting: bool) -> str:
    """The backend name for a request; raises KernelBackendError when it cannot run here."""
    choice = (requested or "auto").strip().lower()
    if choice not in CHOICES:
        raise KernelBackendError(f"{ENV_VAR}={requested!r}: expected one of {', '.join(CHOICES)}")
    if choice == "auto":
        return "triton" if cuda_available and triton_available else "ref"
    if choice == "triton" and not triton_available:
        raise KernelBackendError(f"{ENV_VAR}=triton but triton is not installed (pip install triton)")
    if choice == "triton" and not (cuda_available or interpreting):
        raise KernelBackendError(
            f"{ENV_VAR}=triton needs a CUDA device, or TRITON_INTERPRET=1 (set before importing "
            "kernels) to run the kernels on CPU tensors in Triton's interpreter"
        )
    return choice


def load(name: str) -> ModuleType:
    """The module implementing every op of backend `name` ('ref' or 'triton')."""
    module = importlib.import_module("kernels.ref" if name == "ref" else "kernels.triton")
    missing = [op for op in OPS if not hasattr(module, op)]
    assert not missing, f"backend {name} lacks {missing}"
    return module


def select_from_environment() -> ModuleType:
    import torch

    name = resolve(
        os.environ.get(ENV_VAR, "auto"),
        cuda_available=torch.cuda.is_available(),
        triton_available=_triton_importable(),
        interpreting=triton_interpreting(),
    )
    return load(name)
