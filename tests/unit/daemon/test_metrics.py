"""The data plane's request figures: per-connection tallies summed at scrape time, in the
Prometheus text format a scraper reads (checked by prometheus_client's own parser)."""
from __future__ import annotations

import threading
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.daemon.metrics import LATENCY_BUCKETS, Metrics


def scrape(m: Metrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_live_and_closed_connections_are_summed_and_closing_loses_nothing():
    m = Metrics(lambda: [])
    a, b = m.tally(), m.tally()
    a.observe("put", "ok", 2e-5, 4)
    a.observe("put", "ok", 3e-4, 1)
    b.observe("put", "refused", 5.0, 0)  # past the last bound: +Inf only
    b.observe("get", "ok", 1e-6, 16)
    a.bytes_in, b.bytes_out = 1000, 24
    before = scrape(m)
    m.retire(a)
    m.retire(a)  # a second retire of the same tally counts nothing twice
    assert scrape(m) == before
    ops = ("kvtier_ops_total", (("op", "put"), ("outcome", "ok")))
    assert before[ops] == 2
    assert before["kvtier_ops_total", (("op", "put"), ("outcome", "refused"))] == 1
    assert before["kvtier_op_blocks_total", (("op", "put"),)] == 5
    assert before["kvtier_op_blocks_total", (("op", "get"),)] == 16
    assert before["kvtier_net_bytes_total", (("direction", "in"),)] == 1000
    assert before["kvtier_net_bytes_total", (("direction", "out"),)] == 24
    assert before["kvtier_op_seconds_count", (("op", "put"),)] == 3
    assert abs(before["kvtier_op_seconds_sum", (("op", "put"),)] - 5.00032) < 1e-9


def test_latency_buckets_are_cumulative_with_the_bounds_inclusive():
    m = Metrics(lambda: [])
    t = m.tally()
    for seconds in (LATENCY_BUCKETS[0], LATENCY_BUCKETS[0] * 1.01, 1e9):
        t.observe("get", "ok", seconds, 1)
    got = scrape(m)

    def bucket(le: str) -> float:
        return got["kvtier_op_seconds_bucket", (("le", le), ("op", "get"))]
    assert bucket("1e-05") == 1  # a value on a bound falls in that bound's bucket
    assert bucket("5e-05") == 2
    assert bucket("2.5") == 2
    assert bucket("+Inf") == 3


def test_a_scrape_while_connections_record_sees_counts_that_only_grow():
    m = Metrics(lambda: [])
    stop = threading.Event()
    tallies = [m.tally() for _ in range(4)]

    def record(t):
        while not stop.is_set():
            t.observe("put", "ok", 1e-4, 1)
            t.observe(f"op{t.bytes_in % 7}", "ok", 1e-4, 1)  # new ops appear meanwhile
            t.bytes_in += 1

    threads = [threading.Thread(target=record, args=(t,)) for t in tallies]
    for th in threads:
        th.start()
    try:
        last = 0.0
        for i in range(50):
            now = scrape(m)[("kvtier_ops_total", (("op", "put"), ("outcome", "ok")))]
            assert now >= last
            last = now
            if i == 25:
                m.retire(tallies[0])
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert scrape(m)[("kvtier_ops_total", (("op", "put"), ("outcome", "ok")))] >= last


def test_connections_refused_at_the_limit_leave_no_tally_behind(tmp_path):
    """A connection refused at --max-connections never runs, so its tally must go back
    when it is refused: each one left a live tally that every scrape summed, forever."""
    import socket

    from kvstore.daemon.config import DaemonConfig
    from kvstore.daemon.dataplane import DataPlane, listen
    from kvstore.daemon.namespaces import Registry

    cfg = DaemonConfig(port=0, data_dir=str(tmp_path), max_connections=1, local_socket=False)
    registry = Registry(cfg)
    metrics = Metrics(registry.hosted)
    plane = DataPlane(cfg, registry, metrics, listen("127.0.0.1", 0))
    plane.start()
    clients = []
    try:
        for _ in range(20):
            clients.append(socket.create_connection(("127.0.0.1", plane.port)))
        deadline = time.monotonic() + 10
        while metrics.connections_refused._value.get() < 19 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert metrics.connections_refused._value.get() == 19
        # (the one connection admitted waits in the lobby for its first frame: a tally comes
        # with the thread it gets then)
        assert len(metrics.requests._live) == len(plane.conns) == 0
        assert len(plane.pending) == 1
    finally:
        for c in clients:
            c.close()
        plane.shutdown(1.0)
        registry.close()
    assert not metrics.requests._live


def test_a_connection_whose_thread_cannot_start_is_closed_and_the_lobby_goes_on(
        tmp_path, monkeypatch):
    """New connections wait in one lobby thread, which starts each one's thread once its
    first frame is in. A thread that would not start (a thread or pid limit, memory) took
    the lobby down with it: the daemon accepted no more connections on either listener,
    the connection stayed counted, and shutdown raised. Now that connection is closed and
    uncounted, and the next one is served."""
    import socket
    import threading

    from kvstore import wire as w
    from kvstore.daemon.config import DaemonConfig
    from kvstore.daemon.dataplane import DataPlane, listen
    from kvstore.daemon.namespaces import Registry

    cfg = DaemonConfig(port=0, data_dir=str(tmp_path), max_connections=16, local_socket=False)
    registry = Registry(cfg)
    metrics = Metrics(registry.hosted)
    plane = DataPlane(cfg, registry, metrics, listen("127.0.0.1", 0))
    plane.start()
    real, refused = threading.Thread.start, []

    def start(self):
        if self.name == "kvtier-conn" and not refused:
            refused.append(self)
            raise RuntimeError("can't start new thread")
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    hello = w.encode(w.Hello(token="x"), w.Op.HELLO, False)
    try:
        with socket.create_connection(("127.0.0.1", plane.port), timeout=5) as first:
            first.sendall(hello)
            assert first.recv(1) == b""  # closed
        assert refused and plane.accepting and not plane.conns
        with socket.create_connection(("127.0.0.1", plane.port), timeout=5) as second:
            second.sendall(hello)
            reply = w.recv_frame(second, 1 << 20)
            assert reply.op is w.Op.ERROR  # served (the namespace fields are missing)
        deadline = time.monotonic() + 10
        while metrics.connections._value.get() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert metrics.connections._value.get() == 0
    finally:
        plane.shutdown(1.0)
        registry.close()
