"""Conductor placement (Mooncake's KVCache-centric scheduling, the paper's "global
cache-aware").

For each prefill instance i the estimated TTFT is the smaller of
  local:  queue_i + prefill(uncached suffix | local prefix l_i)
  fetch:  max(queue_i, fetch time of blocks l_i..g from node j) + prefill(suffix | g)
where node j (any node in the index, a prefill instance or a pool, or only the view's
`sources` when it names them) holds the longest prefix g, and fetching is only considered
when g >= balancing_threshold * l_i. The fetched blocks stay on i: a hot prefix gets
replicated where the load lets it run soonest. The fetch runs while the request waits in
the queue, hence the max. The decode instance is the one with
the fastest step that has KV room; with `early_reject` a request whose best estimate misses
the TTFT or TBT SLO is refused before any work is done.
"""
from __future__ import annotations

from typing import NamedTuple

from kvstore.index import PrefixMatch
from kvstore.scheduler.base import (PolicyBase, ClusterView, Placement, PolicyKind, PrefillLoad,
                                    RejectReason, RouteRequest, choose_decode,
                                    prefill_estimate_s)


class _Option(NamedTuple):
    ttft_s: float
    neg_blocks: int  # prefer more reuse on ties
    node_id: str
    cached_blocks: int
    fetch_blocks: int


class ConductorPolicy(PolicyBase):
    kind = PolicyKind.CONDUCTOR

    def choose(self, request: RouteRequest, view: ClusterView) -> Placement:
        match = view.index.query(request.block_hashes)
        source, best_len = match.best(exclude=_not_sources(match, view.sources))
        source_tiers = match.tiers(source) if source is not None else ()
        best = min(self._option(request, p, match, source, best_len, source_tiers)
                   for p in view.prefill)
        decode_node, tbt = choose_decode(request, view, self.config.cost)
        fetch_node = source if best.fetch_blocks else None
        placement = Placement(best.node_id, decode_node, best.cached_blocks, fetch_node,
                              best.fetch_blocks, best.ttft_s, tbt)
        return self._maybe_reject(placement)

    def _option(self, request: RouteRequest, load: PrefillLoad, match: PrefixMatch,
                source: str | None, best_len: int, source_tiers: tuple) -> _Option:
        cost = self.config.cost
        local = match.length(load.node_id)
        local_ttft = load.queue_s + prefill_estimate_s(request, local, cost)
        option = _Option(local_ttft, -local, load.node_id, local, 0)
        if source is None or source == load.node_id or best_len <= local:
            return option
        if best_len < self.config.balancing_threshold * local:
            return option
        fetch_s = cost.transfer.fetch_s(source_tiers[local:best_len], cost.block_bytes)
        fetch_ttft = max(load.queue_s, fetch_s) + prefill_estimate_s(request, best_len, cost)
        if fetch_ttft < local_ttft:
            option = _Option(fetch_ttft, -best_len, load.node_id, local, best_len - local)
        return option

    def _maybe_reject(self, placement: Placement) -> Placement:
        if not self.config.early_reject:
            return placement
        if placement.estimated_ttft_s > self.config.ttft_slo_s:
            return placement._replace(reject=RejectReason.TTFT_SLO)
        if placement.estimated_tbt_s > self.config.tbt_slo_s:
            return placement._replace(reject=RejectReason.TBT_SLO)
        return placement


def _not_sources(match: PrefixMatch, sources: frozenset[str] | None) -> tuple[str, ...]:
    return () if sources is None else tuple(n for n in match.nodes() if n not in sources)
