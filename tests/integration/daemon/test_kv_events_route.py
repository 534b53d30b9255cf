"""GET /kv/events on a real daemon: a snapshot first, then only the events after a seq, a
snapshot again for a reader that fell behind, bad queries refused, tenants kept apart."""
from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import pytest

from kvstore import Client
from kvstore.cluster.messages import EVENTS_KIND_HEADER, EventBatch, Snapshot
from kvstore.events import MAX_BUFFERED, EventKind, TierKind
from kvstore.keys import Namespace, hash_blocks

from .conftest import NS, block_of


def chain(seed: int, n: int) -> list[bytes]:
    return hash_blocks(NS, np.arange(n * NS.block_tokens) + seed * 5_000_011)


def read(daemon, ns: Namespace, after: int | None = None, token: str = ""):
    q = f"ns={ns.ns_id:x}" + ("" if after is None else f"&after={after}")
    req = urllib.request.Request(f"{daemon.http}/kv/events?{q}",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        kind, body = r.headers[EVENTS_KIND_HEADER], r.read()
    return kind, (Snapshot if kind == "snapshot" else EventBatch).decode(body)


def test_snapshot_then_events_after_a_seq(make_daemon):
    d = make_daemon("--dram-size", "1MiB")
    kind, snap = read(d, NS)
    assert kind == "snapshot" and snap.seq == -1 and not any(snap.blocks.values())
    hs = chain(1, 6)
    with Client(d.url, namespace=NS) as c:
        c.put_n(hs[:4], [block_of(h, NS.block_bytes) for h in hs[:4]])
        assert c.contains_n(hs[:4]) == [True] * 4  # committed (a put channel commits later)
        kind, snap = read(d, NS)
        assert kind == "snapshot" and sorted(snap.blocks[TierKind.DRAM]) == sorted(hs[:4])
        c.put_n(hs[4:], [block_of(h, NS.block_bytes) for h in hs[4:]])
        assert c.remove(hs[0])
        kind, batch = read(d, NS, after=snap.seq)
        assert kind == "events" and [e.seq for e in batch.events] == \
            list(range(snap.seq + 1, snap.seq + 1 + len(batch.events)))
        stored = {h for e in batch.events if e.kind is EventKind.STORED for h in e.block_hashes}
        removed = {h for e in batch.events if e.kind is EventKind.REMOVED for h in e.block_hashes}
        assert stored == set(hs[4:]) and removed == {hs[0]}
        last = batch.events[-1].seq
        assert read(d, NS, after=last) == ("events", EventBatch(batch.node_id, NS.ns_id, ()))


def test_a_reader_that_fell_behind_gets_a_snapshot(make_daemon):
    d = make_daemon("--dram-size", "64MiB")
    hs = chain(2, MAX_BUFFERED + 50)
    with Client(d.url, namespace=NS, use_shm=False) as c:
        _, first = read(d, NS)
        for k in range(0, len(hs), 1):  # one event per put: more than the ring keeps
            c.put_n(hs[k:k + 1], [block_of(hs[k], NS.block_bytes)])
        kind, snap = read(d, NS, after=first.seq)
        assert kind == "snapshot" and len(snap.blocks[TierKind.DRAM]) == len(hs)


def test_bad_queries_and_tenants(make_daemon, tmp_path):
    (tmp_path / "tokens").write_text("admin\nalice-secret alice\nbob-secret bob\n")
    d = make_daemon("--token-file", str(tmp_path / "tokens"))
    alice = Namespace("m", num_layers=1, num_kv_heads=1, head_dim=64, tenant="alice")
    with Client(d.url, "alice-secret", namespace=alice) as c:
        c.put_n(chain(3, 2), [block_of(h, alice.block_bytes) for h in chain(3, 2)])
        c.contains_n(chain(3, 2))
    _, snap = read(d, alice, token="alice-secret")
    assert len(snap.blocks[TierKind.DRAM]) == 2
    _, other = read(d, alice, token="bob-secret")  # bob cannot see alice's namespace
    assert not any(other.blocks.values())
    for query, code in (("", 400), ("ns=zz", 400), (f"ns={alice.ns_id:x}&after=x", 400),
                        ("ns=" + "f" * 17, 400), ("ns=-1", 400),  # wider than 64 bits
                        (f"ns={alice.ns_id:x}&after={1 << 64}", 400),
                        (f"ns={alice.ns_id:x}&after=-2", 400)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(
                f"{d.http}/kv/events?{query}", headers={"Authorization": "Bearer admin"}))
        assert e.value.code == code
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{d.http}/kv/events?ns={alice.ns_id:x}")  # no token
    assert e.value.code == 401
