"""Errors raised by the kernel launchers, before any kernel runs.

Every error is a `KernelInputError` (a `ValueError`), so a caller can catch one class; the
dtype error is also a `TypeError`. Messages name the argument and say what was expected.
"""
from __future__ import annotations


class KernelInputError(ValueError):
    """An argument of a kernel op has the wrong shape, layout, device or value."""


class KernelShapeError(KernelInputError):
    """A tensor's shape or strides do not match the op's contract."""


class KernelDTypeError(KernelInputError, TypeError):
    """A tensor's dtype is not supported or does not match the other tensors."""


class KernelDeviceError(KernelInputError):
    """Tensors live on different devices, or on one the chosen backend cannot run on."""


class KernelIndexError(KernelInputError):
    """A block id, slot or length is out of range (checked on the values, on the host)."""


class KernelBackendError(RuntimeError):
    """`KVTIER_KERNELS` names a backend that cannot run here (raised once, at import)."""
