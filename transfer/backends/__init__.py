"""Transport backends. `load(kind)` imports one only when an agent asks for it, so the
optional adapters (nixl, ucx) cost nothing where their libraries are absent."""
from __future__ import annotations

import importlib

from ..errors import Fault, TransferError
from ..types import BackendKind

_MODULES = {
    BackendKind.LOCAL: ("local", "LocalBackend"),
    BackendKind.SHM: ("shm", "ShmBackend"),
    BackendKind.TCP: ("tcp", "TcpBackend"),
    BackendKind.NIXL: ("nixl", "NixlBackend"),
    BackendKind.UCX: ("ucx", "UcxBackend"),
}


def load(kind: BackendKind) -> type:
    module, cls = _MODULES[kind]
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ImportError as e:
        raise TransferError(Fault.UNSUPPORTED, f"backend {kind.value} unavailable: {e}") from e
    return getattr(mod, cls)
