"""Prefix placement (the paper's "local cache-aware"): the prefill instance with the lowest
estimated TTFT counting only the prefix cached on that instance itself; no fetching from
other nodes. With equal queues this is the instance with the longest local hit."""
from __future__ import annotations

from kvstore.scheduler.base import (PolicyBase, ClusterView, Placement, PolicyKind, RouteRequest,
                                    choose_decode,
                                    prefill_estimate_s)


class PrefixPolicy(PolicyBase):
    kind = PolicyKind.PREFIX

    def choose(self, request: RouteRequest, view: ClusterView) -> Placement:
        match = view.index.query(request.block_hashes)
        cost = self.config.cost
        best = min(
            ((p.queue_s + prefill_estimate_s(request, match.length(p.node_id), cost),
              -match.length(p.node_id), p.node_id) for p in view.prefill)
        )
        ttft, neg_blocks, node = best
        decode_node, tbt = choose_decode(request, view, cost)
        return Placement(node, decode_node, cached_blocks=-neg_blocks,
                         estimated_ttft_s=ttft, estimated_tbt_s=tbt)
