"""Least-loaded placement (the paper's "load balancing"): shortest prefill queue, fastest
decode step; blind to where prefixes are cached."""
from __future__ import annotations

from kvstore.scheduler.base import (PolicyBase, ClusterView, Placement, PolicyKind, RouteRequest,
                                    choose_decode,
                                    prefill_estimate_s)


class LeastLoadedPolicy(PolicyBase):
    kind = PolicyKind.LEAST_LOADED

    def choose(self, request: RouteRequest, view: ClusterView) -> Placement:
        prefill = min(view.prefill, key=lambda p: (p.queue_s, p.node_id))
        decode_node, tbt = choose_decode(request, view, self.config.cost)
        ttft = prefill.queue_s + prefill_estimate_s(request, 0, self.config.cost)
        return Placement(prefill.node_id, decode_node, estimated_ttft_s=ttft,
                         estimated_tbt_s=tbt)
