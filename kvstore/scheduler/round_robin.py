"""Round-robin placement: even request counts, blind to load and cache."""
from __future__ import annotations

from kvstore.scheduler.base import (PolicyBase, ClusterView, Placement, PolicyKind, RouteRequest,
                                    SchedulerConfig)


class RoundRobinPolicy(PolicyBase):
    kind = PolicyKind.ROUND_ROBIN

    def __init__(self, config: SchedulerConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._next = seed

    def choose(self, request: RouteRequest, view: ClusterView) -> Placement:
        n = self._next
        self._next += 1
        prefill = view.prefill[n % len(view.prefill)]
        decode = view.decode[n % len(view.decode)]
        return Placement(prefill.node_id, decode.node_id)
