"""Prometheus metrics of one daemon, in its own CollectorRegistry (never the global one).

Connections are counted by the data plane as they come and go. Each connection's requests
(counts by op and outcome, latencies, blocks, payload bytes) go into its own `OpTally`,
written by its thread alone with no lock; a collector sums the live tallies and those of
closed connections at scrape time. (A prometheus Counter or Histogram takes a lock per
update: recording one request through them cost 5 lock visits and ~17 calls.) Per-tier
store figures (hits, misses, bytes, evictions, demotions, promotions, fill) are read from
every hosted store's `stats()` at scrape time too.
"""
from __future__ import annotations

import bisect
import threading
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.utils import floatToGoString

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


class OpFigures:
    """One op's figures on one connection."""

    __slots__ = ("outcomes", "buckets", "seconds", "blocks")

    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket, not cumulative; +Inf last
        self.seconds = 0.0
        self.blocks = 0

    def add(self, other: "OpFigures") -> None:
        for outcome, n in other.outcomes.copy().items():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets)]
        self.seconds += other.seconds
        self.blocks += other.blocks


class OpTally:
    """A connection's requests so far. Written by that connection's thread only; read by
    the collector at scrape time (copies of dicts, taken whole under the GIL: a figure may
    be one request behind, never torn or lost)."""

    __slots__ = ("ops", "bytes_in", "bytes_out")

    def __init__(self) -> None:
        self.ops: dict[str, OpFigures] = {}
        self.bytes_in = self.bytes_out = 0  # payload bytes received and sent

    def observe(self, op: str, outcome: str, seconds: float, num_blocks: int) -> None:
        f = self.ops.get(op)
        if f is None:
            f = self.ops[op] = OpFigures()
        f.outcomes[outcome] = f.outcomes.get(outcome, 0) + 1
        f.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        f.seconds += seconds
        f.blocks += num_blocks

    def add(self, other: "OpTally") -> None:
        for op, figures in other.ops.copy().items():
            self.ops.setdefault(op, OpFigures()).add(figures)
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out


class TallyCollector:
    """The data plane's request figures: closed connections' tallies, summed as they
    close, plus every live one's, read at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._retired = OpTally()
        self._live: set[OpTally] = set()

    def open(self) -> OpTally:
        t = OpTally()
        with self._lock:
            self._live.add(t)
        return t

    def close(self, t: OpTally) -> None:
        with self._lock:
            if t in self._live:
                self._live.discard(t)
                self._retired.add(t)

    def total(self) -> OpTally:
        with self._lock:
            total = OpTally()
            for t in [self._retired, *self._live]:
                total.add(t)
        return total

    def collect(self) -> Iterable:
        total = self.total()
        ops = CounterMetricFamily("kvtier_ops", "data-plane requests by op and outcome",
                                  labels=["op", "outcome"])
        latency = HistogramMetricFamily("kvtier_op_seconds", "data-plane request latency by op",
                                        labels=["op"])
        blocks = CounterMetricFamily("kvtier_op_blocks", "blocks named in data-plane requests",
                                     labels=["op"])
        net = CounterMetricFamily("kvtier_net_bytes", "payload bytes over the data plane",
                                  labels=["direction"])
        for op, f in sorted(total.ops.items()):
            for outcome, n in sorted(f.outcomes.items()):
                ops.add_metric([op, outcome], n)
            cumulative, rows = 0, []
            for bound, n in zip((*LATENCY_BUCKETS, float("inf")), f.buckets):
                cumulative += n
                rows.append((floatToGoString(bound), cumulative))
            latency.add_metric([op], rows, sum_value=f.seconds)
            blocks.add_metric([op], f.blocks)
        net.add_metric(["in"], total.bytes_in)
        net.add_metric(["out"], total.bytes_out)
        yield from (ops, latency, blocks, net)


class Metrics:
    def __init__(self, hosted: Callable[[], list[Hosted]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = TallyCollector()
        r.register(self.requests)
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

    def tally(self) -> OpTally:
        """A new connection's tally (give it back with `retire` when the connection ends)."""
        return self.requests.open()

    def retire(self, tally: OpTally) -> None:
        self.requests.close(tally)
