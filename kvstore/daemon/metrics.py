"""Prometheus metrics of one daemon, in its own CollectorRegistry (never the global one).

Op counts, latencies, bytes and connections are recorded by the data plane as they happen;
per-tier store figures (hits, misses, bytes, evictions, demotions, promotions, fill) are read
from every hosted store's `stats()` at scrape time by a custom collector.
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.daemon.namespaces import Hosted

LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5)
_COUNTERS = ("hits", "bytes_in", "bytes_out", "demotions_in", "demotions_out",
             "promotions_in", "evictions", "corrupt")


class StoreCollector:
    def __init__(self, hosted: Callable[[], list[Hosted]]) -> None:
        self._hosted = hosted

    def collect(self) -> Iterable:
        counters = {name: CounterMetricFamily(f"kvtier_tier_{name}", f"per-tier {name} "
                                              "(blocks or bytes) since start",
                                              labels=["namespace", "tier"])
                    for name in _COUNTERS}
        used = GaugeMetricFamily("kvtier_tier_used_blocks", "blocks held per tier",
                                 labels=["namespace", "tier"])
        capacity = GaugeMetricFamily("kvtier_tier_capacity_blocks", "slots per tier",
                                     labels=["namespace", "tier"])
        misses = CounterMetricFamily("kvtier_misses", "block reads that found nothing",
                                     labels=["namespace"])
        lease_hits = CounterMetricFamily("kvtier_lease_hits", "DRAM blocks read through "
                                         "leases (shared memory or zero-copy TCP); part of the tier hits",
                                         labels=["namespace"])
        direct_hits = CounterMetricFamily("kvtier_direct_hits", "DRAM blocks a same-host "
                                          "client copied from published slots with no request "
                                          "(reported in batches); part of the tier hits",
                                          labels=["namespace"])
        write_errors = CounterMetricFamily("kvtier_store_write_errors", "puts a tier could "
                                           "not store (disk full, I/O error): answered NO_SPACE",
                                           labels=["namespace"])
        bg_errors = CounterMetricFamily("kvtier_store_background_errors", "background "
                                        "maintenance passes that failed (logged; the thread "
                                        "carries on)", labels=["namespace"])
        for h in self._hosted():
            s = h.store.stats()
            write_errors.add_metric([h.label], s.write_errors)
            bg_errors.add_metric([h.label], s.background_errors)
            misses.add_metric([h.label], s.misses)
            lease_hits.add_metric([h.label], h.lease_hits)
            direct_hits.add_metric([h.label], h.direct_hits)
            for t in s.tiers:
                labels = [h.label, t.kind.name.lower()]
                used.add_metric(labels, t.used_blocks)
                capacity.add_metric(labels, t.capacity_blocks)
                for name in _COUNTERS:
                    counters[name].add_metric(labels, getattr(t.counters, name))
        yield from counters.values()
        yield from (used, capacity, misses, lease_hits, direct_hits, write_errors, bg_errors)


class Metrics:
    def __init__(self, hosted: Callable[[], list[Hosted]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ops = Counter("kvtier_ops", "data-plane requests by op and outcome",
                           ["op", "outcome"], registry=r)
        self.latency = Histogram("kvtier_op_seconds", "data-plane request latency by op",
                                 ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.blocks = Counter("kvtier_op_blocks", "blocks named in data-plane requests",
                              ["op"], registry=r)
        self.net_bytes = Counter("kvtier_net_bytes", "payload bytes over the data plane",
                                 ["direction"], registry=r)
        self.connections = Gauge("kvtier_connections", "open data-plane connections",
                                 registry=r)
        self.connections_total = Counter("kvtier_connections_accepted",
                                         "data-plane connections accepted", registry=r)
        self.protocol_errors = Counter("kvtier_protocol_errors",
                                       "connections closed for a protocol error", registry=r)
        self.internal_errors = Counter("kvtier_internal_errors", "requests that failed "
                                       "inside the daemon (logged with a traceback)", registry=r)
        self.connections_refused = Counter("kvtier_connections_refused", "connections "
                                           "refused at the connection limits", registry=r)
        self.accept_errors = Counter("kvtier_accept_errors", "accept() failures for want of "
                                     "descriptors or memory (accepting pauses, then resumes)",
                                     registry=r)
        self.namespaces_failed = Gauge("kvtier_namespaces_failed", "namespace directories "
                                       "found at start that could not be opened (not served; "
                                       "see the log)", registry=r)
        r.register(StoreCollector(hosted))
        self.bytes_in, self.bytes_out = self.net_bytes.labels("in"), self.net_bytes.labels("out")
        self._children: dict[tuple[str, str], tuple] = {}  # labels() costs ~2 us per call

    def observe(self, op: str, outcome: str, seconds: float, num_blocks: int) -> None:
        c = self._children.get((op, outcome))
        if c is None:
            c = self._children[op, outcome] = (self.ops.labels(op, outcome),
                                               self.latency.labels(op), self.blocks.labels(op))
        c[0].inc()
        c[1].observe(seconds)
        if num_blocks:
            c[2].inc(num_blocks)
