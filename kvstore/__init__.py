"""kvtier's storage tier. `kvstore.connect` / `kvstore.Client` / `kvstore.AsyncClient` load on
first use, so `import kvstore` stays light (no torch, no sockets)."""
from __future__ import annotations

__all__ = ["AsyncClient", "Client", "connect"]


def __getattr__(name: str):
    if name in __all__:
        from kvstore import client
        return getattr(client, name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
