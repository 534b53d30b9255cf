"""Objects that hold what a child made by os.fork() must not use: sockets, shared rings,
mappings its parent still uses (`transfer.Agent`, kvstore's clients). In the child each
tracked object's `_after_fork()` runs first thing, and lets go of those without touching
anything the parent uses: no request sent, no shutdown of a shared socket, no lock the
parent's threads may have held."""
from __future__ import annotations

import os
import weakref

_live: "weakref.WeakSet" = weakref.WeakSet()


def track(obj) -> None:
    """Have `obj._after_fork()` called in every child this process forks from now on."""
    _live.add(obj)


def _in_child() -> None:
    for obj in list(_live):
        try:
            obj._after_fork()
        except Exception:  # noqa: BLE001 - best effort: the child must go on starting
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
