"""Least-loaded placement (the paper's "load balancing"): shortest prefill queue, fastest
decode step; blind to where prefixes are cached."""
from __future__ import annotations

from kvstore.scheduler.base import (ClusterView, Placement, PolicyKind, Request,
                                    SchedulerConfig, choose_decode, no_instance,
                                    prefill_estimate_s)


class LeastLoadedPolicy:
    kind = PolicyKind.LEAST_LOADED

    def __init__(self, config: SchedulerConfig, seed: int = 0) -> None:
        self.config = config

    def place(self, request: Request, view: ClusterView) -> Placement:
        missing = no_instance(view)
        if missing:
            return missing
        prefill = min(view.prefill, key=lambda p: (p.queue_s, p.node_id))
        decode_node, tbt = choose_decode(request, view, self.config.cost)
        ttft = prefill.queue_s + prefill_estimate_s(request, 0, self.config.cost)
        return Placement(prefill.node_id, decode_node, estimated_ttft_s=ttft,
                         estimated_tbt_s=tbt)
