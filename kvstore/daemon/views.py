"""JSON shapes of the control plane (strings live only at the HTTP edge)."""
from __future__ import annotations

from dataclasses import asdict

from kvstore.daemon.namespaces import Hosted


def namespace_row(h: Hosted) -> dict:
    return {"ns_id": f"{h.ns.ns_id:016x}", **asdict(h.ns), "block_bytes": h.ns.block_bytes,
            "quota_blocks": h.quota_blocks, "tiers": [k.name.lower() for k in h.store.tier_kinds]}


def stats_rows(hosted: list[Hosted]) -> list[dict]:
    rows = []
    for h in hosted:
        s = h.store.stats()
        rows.append({
            "ns_id": f"{h.ns.ns_id:016x}", "model": h.ns.model, "tenant": h.ns.tenant,
            "block_bytes": s.block_bytes, "misses": s.misses, "hits": s.hits,
            "lease_hits": h.lease_hits,
            "direct_hits": h.direct_hits,
            "open_reservations": s.open_reservations, "open_leases": s.open_leases,
            "tiers": [{"tier": t.kind.name.lower(), "capacity_blocks": t.capacity_blocks,
                       "used_blocks": t.used_blocks, **vars(t.counters)} for t in s.tiers]})
    return rows
