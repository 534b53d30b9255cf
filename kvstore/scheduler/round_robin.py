"""Round-robin placement: even request counts, blind to load and cache."""
from __future__ import annotations

from kvstore.scheduler.base import (ClusterView, Placement, PolicyKind, Request,
                                    SchedulerConfig, no_instance)


class RoundRobinPolicy:
    kind = PolicyKind.ROUND_ROBIN

    def __init__(self, config: SchedulerConfig, seed: int = 0) -> None:
        self.config = config
        self._next = seed

    def place(self, request: Request, view: ClusterView) -> Placement:
        missing = no_instance(view)
        if missing:
            return missing
        n = self._next
        self._next += 1
        prefill = view.prefill[n % len(view.prefill)]
        decode = view.decode[n % len(view.decode)]
        return Placement(prefill.node_id, decode.node_id)
