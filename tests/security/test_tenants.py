"""Tenants cannot starve each other, and no namespace can keep the daemon from starting:
per-tenant namespace and byte quotas, nothing left behind by a refused namespace, a
namespace found broken at start set aside while the others are served, and one tenant's
new namespace (its arena faulted in) holding up no other tenant's requests."""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import numpy as np
import pytest

from kvstore import Client
from kvstore import wire as w
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks

from .conftest import ALICE, BOB, block_of, call, hello_msg, metric, raw_conn


def ns_of(tenant: str, i: int, **kw) -> Namespace:
    return Namespace(f"model-{i}", num_layers=1, num_kv_heads=1, head_dim=64, tenant=tenant, **kw)


def hello_code(d, ns: Namespace, token: str, timeout: float = 5) -> int:
    with raw_conn(d, timeout) as s:
        reply = call(s, hello_msg(ns, token))
        return reply.msg.code if reply.op is w.Op.ERROR else 0


def test_namespace_limits_are_per_tenant(make_daemon, token_file):
    d = make_daemon("--token-file", token_file, "--max-namespaces", "2",
                    "--max-namespaces-total", "3")
    assert hello_code(d, ns_of("alice", 1), "alice-secret") == 0
    assert hello_code(d, ns_of("alice", 2), "alice-secret") == 0
    assert hello_code(d, ns_of("alice", 3), "alice-secret") == w.ErrorCode.QUOTA
    assert hello_code(d, ns_of("bob", 1), "bob-secret") == 0, "alice starved bob"
    assert hello_code(d, ns_of("bob", 2), "bob-secret") == w.ErrorCode.QUOTA  # the total
    assert hello_code(d, ns_of("alice", 1), "alice-secret") == 0  # an open one stays open


def test_memory_and_disk_quotas_are_per_tenant(make_daemon, token_file):
    d = make_daemon("--token-file", token_file, "--tenant-memory", "64KiB",
                    "--tenant-disk", "160KiB", dram_size="48KiB", ssd_size="96KiB")
    tiers = []
    for i in range(2):
        with Client(d.url, "alice-secret", ns_of("alice", i)) as c:
            tiers.append({t.kind: t.capacity_blocks for t in c.stats().tiers})
    assert tiers[0] == {TierKind.DRAM: 12, TierKind.SSD: 24}
    assert tiers[1] == {TierKind.DRAM: 4, TierKind.SSD: 16}     # what was left of 64K / 160K
    assert hello_code(d, ns_of("alice", 2), "alice-secret") == w.ErrorCode.QUOTA
    with Client(d.url, "bob-secret", ns_of("bob", 0)) as c:     # bob has his own budget
        assert {t.kind: t.capacity_blocks for t in c.stats().tiers} == tiers[0]


def test_a_refused_namespace_leaves_nothing_and_the_daemon_restarts(make_daemon, token_file,
                                                                   tmp_path):
    data = tmp_path / "data"
    d = make_daemon("--token-file", token_file, dram_size="8KiB", ssd_size="8KiB",
                    data_dir=str(data))
    huge = Namespace("huge", num_layers=64, num_kv_heads=8, head_dim=128, tenant="alice")
    assert hello_code(d, huge, "alice-secret") == w.ErrorCode.NAMESPACE
    assert os.listdir(data) == [] if data.exists() else True
    assert d.stop() == 0
    d.start()  # the same data dir: nothing there blocks the start
    assert d.get_json("/healthz")["status"] == "ok"


def test_a_broken_namespace_at_start_is_set_aside_and_the_rest_served(make_daemon, token_file,
                                                                     tmp_path):
    data = tmp_path / "data"
    d = make_daemon("--token-file", token_file, data_dir=str(data))
    hs = hash_blocks(ALICE, np.arange(4 * 16))
    with Client(d.url, "alice-secret", ALICE, use_shm=False) as c:
        c.put_n(hs, np.stack([block_of(h, ALICE.block_bytes) for h in hs]))
    with Client(d.url, "bob-secret", BOB, use_shm=False) as c:
        c.put_n(hs[:1], [block_of(hs[0], BOB.block_bytes)])
    assert d.stop() == 0
    bob_dir = data / f"{BOB.ns_id:016x}"
    (bob_dir / "namespace.json").write_text("{not json")
    junk = data / "0123456789abcdef"
    junk.mkdir()
    (junk / "namespace.json").write_text(json.dumps({"model": "x", "num_layers": 2 ** 40,
                                                     "num_kv_heads": 1, "head_dim": 1}))
    d.start()
    health = d.get_json("/healthz")
    assert health["status"] == "ok" and health["namespaces_failed"] == 2
    assert metric(d, "kvtier_namespaces_failed") == 2
    assert set(d.get_json("/stats", "admin-secret")["namespaces_failed"]) == {
        bob_dir.name, junk.name}
    assert "not opened" in d.output()
    with Client(d.url, "alice-secret", ALICE, use_shm=False) as c:  # alice's blocks are served
        out = np.zeros((4, ALICE.block_bytes), np.uint8)
        assert c.get_n(hs, out) == [TierKind.SSD] * 4
    assert (bob_dir / "ssd").exists(), "a broken namespace's files were touched"


@pytest.mark.parametrize("token", ["", "alice-secret"])
def test_admin_views_need_an_admin_token(make_daemon, token_file, token):
    d = make_daemon("--token-file", token_file)
    import urllib.error
    with pytest.raises(urllib.error.HTTPError):
        d.get_json("/metrics", token)


def _shmem_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def test_a_namespace_being_made_holds_up_no_other_tenants_requests(make_daemon, token_file):
    """Making a namespace faults its whole DRAM arena in (~0.5 s a GiB here). That ran with
    the GIL held (mmap.madvise keeps it) and under the registry's lock: a tenant making
    namespaces again and again (HELLO of a new one, then clear it) stopped every other
    tenant's requests, new connections and the HTTP routes for as long. While bob's arena
    is faulted in, alice gets a block on her connection, opens another, and reads /stats."""
    gib = 1 << 30
    d = make_daemon("--token-file", token_file, dram_size="2GiB", ssd_size="0")
    with raw_conn(d, timeout=30) as s:
        assert call(s, hello_msg(ALICE, "alice-secret")).op is w.Op.HELLO
        h = bytes(range(16))
        assert call(s, w.Put(hashes=h), [b"\1" * ALICE.block_bytes]).msg.statuses == b"\0"
        base = _shmem_kib(d.pid)
        done = []
        bob = threading.Thread(target=lambda: done.append(  # (a 2 GiB arena faulted in on a
            hello_code(d, ns_of("bob", 9), "bob-secret", timeout=60)))  # loaded CI host
        # took longer than the default 5 s)
        bob.start()
        try:
            deadline = time.monotonic() + 30
            while _shmem_kib(d.pid) - base < (64 << 20) // 1024:  # its arena is under way
                assert time.monotonic() < deadline and not done, "bob's arena never grew"
                time.sleep(0.001)
            reply = call(s, w.Get(hashes=h))
            assert reply.msg.tiers == bytes([TierKind.DRAM])
            got = bytearray(reply.payload_bytes)
            w.recv_exact(s, memoryview(got))
            assert got == b"\1" * ALICE.block_bytes
            assert hello_code(d, ALICE, "alice-secret") == 0
            req = urllib.request.Request(d.http + "/stats",
                                         headers={"Authorization": "Bearer alice-secret"})
            assert urllib.request.urlopen(req, timeout=30).status == 200
            faulted = (_shmem_kib(d.pid) - base) * 1024
            assert faulted < 1.9 * gib, "alice waited for bob's whole arena"
        finally:
            bob.join(60)
        assert done == [0] and (_shmem_kib(d.pid) - base) * 1024 >= 1.9 * gib


def test_the_dram_tiers_of_all_namespaces_stay_within_the_daemons_memory(make_daemon,
                                                                        token_file):
    """Each namespace's DRAM tier is held in memory from its first HELLO: at the defaults
    one tenant's token held 8 GiB, and a few tenants more than the host had. The DRAM tiers
    of all namespaces now stay within --max-memory (else the host's): the one that does not
    fit is refused (QUOTA, saying why), whoever asks, and a cleared one makes room."""
    d = make_daemon("--token-file", token_file, "--max-memory", "40KiB", dram_size="16KiB",
                    ssd_size="0")
    assert hello_code(d, ns_of("alice", 1), "alice-secret") == 0
    assert hello_code(d, ns_of("bob", 1), "bob-secret") == 0
    with raw_conn(d) as s:
        reply = call(s, hello_msg(ns_of("alice", 2), "alice-secret"))
    assert reply.op is w.Op.ERROR and reply.msg.code == w.ErrorCode.QUOTA
    assert "--max-memory" in reply.msg.message and "2 namespaces" in reply.msg.message
    assert hello_code(d, ns_of("bob", 2), "admin-secret") == w.ErrorCode.QUOTA
    ns_id = f"{ns_of('alice', 1).ns_id:016x}"
    req = urllib.request.Request(f"{d.http}/admin/namespaces/{ns_id}/clear", method="POST",
                                 headers={"Authorization": "Bearer alice-secret"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.load(r) == {"cleared": ns_id}
    assert hello_code(d, ns_of("alice", 2), "alice-secret") == 0
