"""Daemon lifecycle: SIGTERM flushes and a restart finds every block; clients reconnect;
SIGKILL mid-load never serves a corrupted block; metrics, admin and the config file; the
output a launcher copies (`echo`)."""
from __future__ import annotations

import io
import os
import multiprocessing as mp
import threading
import time
import urllib.request

import numpy as np
import pytest

from kvstore import Client
from kvstore.api import PutStatus
from kvstore.client.errors import ConnectError
from kvstore.daemon.process import freeze
from kvstore.events import TierKind
from kvstore.keys import hash_blocks

from .conftest import NS, block_of

BB = NS.block_bytes


def blocks(hs):
    return np.stack([block_of(h, BB) for h in hs])


def test_sigterm_flushes_and_restart_finds_everything(make_daemon, tmp_path):
    d = make_daemon()
    hs = hash_blocks(NS, np.arange(100 * 16))  # 100 blocks: 64 fit DRAM, the rest on SSD
    c = Client(d.url, namespace=NS)
    c.put_n(hs, blocks(hs))
    assert d.stop() == 0  # graceful: exit 0 after flushing DRAM to SSD
    d.start()  # same port, same data dir
    dst = np.zeros((100, BB), np.uint8)
    assert None not in c.get_n(hs, dst)  # the same Client reconnects on its own
    assert (dst == blocks(hs)).all()
    c.close()


def test_a_graceful_stop_keeps_every_same_host_put_it_answered_stored(make_daemon):
    """Puts through the put channel (no request: the client copies into granted slots and
    publishes a record) while SIGTERM stops the daemon: every block a put answered STORED
    or EXISTS is there after the restart, with its bytes. The stop drained each channel
    and closed it, the client kept publishing into the ring nobody drained any more and
    answered STORED: 20 of 80 blocks were found after the restart."""
    for rnd in range(3):
        d = make_daemon("--dram-size", "1MiB")  # 256 slots: the channel is granted 64
        hs = hash_blocks(NS, np.arange(600 * 16) + 10**6 * rnd)
        told: list[bytes] = []
        started, channel = threading.Event(), []

        def put_until_it_fails() -> None:
            with Client(d.url, namespace=NS) as c:
                try:
                    for i in range(0, len(hs), 4):
                        got = c.put_n(hs[i:i + 4], blocks(hs[i:i + 4]))
                        told.extend(h for h, s in zip(hs[i:i + 4], got)
                                    if s in (PutStatus.STORED, PutStatus.EXISTS))
                        if not channel:
                            channel.append(c._puts is not None)  # (no request: the ring)
                        started.set()
                except ConnectError:
                    pass  # the daemon is gone: this put was not answered STORED
                finally:
                    started.set()

        writer = threading.Thread(target=put_until_it_fails)
        writer.start()
        assert started.wait(30)
        assert d.stop() == 0
        writer.join(30)
        assert not writer.is_alive() and channel == [True]
        d.start()
        with Client(d.url, namespace=NS) as c:
            dst = np.zeros((len(told), BB), np.uint8)
            found = c.get_n(told, dst) if told else []
            missing = [i for i, t in enumerate(found) if t is None]
            assert not missing, f"round {rnd}: {len(missing)} of {len(told)} blocks answered STORED are gone"
            assert (dst == blocks(told)).all()
        d.close()


def test_sigkill_mid_load_serves_no_corrupted_block(make_daemon, tmp_path):
    d = make_daemon("--dram-size", "16KiB")  # 4 DRAM slots: most blocks go to SSD
    hs = hash_blocks(NS, np.arange(400 * 16) + 99)
    ctx = mp.get_context("spawn")
    loader = ctx.Process(target=_load, args=(d.url, hs), daemon=True)
    loader.start()
    with Client(d.url, namespace=NS) as c:
        deadline = time.monotonic() + 30
        while c.stats().tier(TierKind.SSD).used_blocks < 40 and time.monotonic() < deadline:
            time.sleep(0.02)
        d.kill()  # SIGKILL while the loader is still putting
    loader.join(30)
    d.start()
    with Client(d.url, namespace=NS) as c:
        dst = np.zeros((len(hs), BB), np.uint8)
        found = c.get_n(hs, dst)
        hits = [i for i, t in enumerate(found) if t is not None]
        assert len(hits) >= 30  # committed SSD blocks survived (WAL on)
        for i in hits:
            assert (dst[i] == block_of(hs[i], BB)).all()


def test_a_removed_block_stays_removed_after_sigkill(make_daemon):
    """An acknowledged remove of SSD blocks is durable: the index deletes are written at
    once (they used to wait for the next put's index write, so a SIGKILL before it brought
    the removed blocks back); the blocks not removed survive as before."""
    d = make_daemon("--dram-size", "16KiB")  # 4 DRAM slots: most blocks go to SSD
    hs = hash_blocks(NS, np.arange(24 * 16) + 7)
    with Client(d.url, namespace=NS) as c:
        c.put_n(hs, blocks(hs))
        on_ssd = [h for h in hs if c.match_prefix([h]).tiers == (TierKind.SSD,)]
        assert len(on_ssd) >= 12
        gone, kept = on_ssd[:6], on_ssd[6:]
        assert c.remove_n(gone) == len(gone)
    d.kill()  # no put after the remove: nothing else would have written the deletes
    d.start()
    with Client(d.url, namespace=NS) as c:
        assert c.contains_n(gone) == [False] * len(gone)
        dst = np.zeros((len(kept), BB), np.uint8)
        assert None not in c.get_n(kept, dst)
        assert all((row == block_of(h, BB)).all() for row, h in zip(dst, kept))


def _load(url, hs):
    try:
        with Client(url, namespace=NS, timeout_s=5) as c:
            for i in range(0, len(hs), 4):
                c.put_n(hs[i:i + 4], blocks(hs[i:i + 4]))
    except Exception:
        pass  # the daemon was killed under us: that is the point


def test_timeout_and_unreachable_errors(make_daemon):
    from kvstore.client import ConnectError
    d = make_daemon()
    c = Client(d.url, namespace=NS)
    d.stop()
    with pytest.raises(ConnectError, match="kvtier serve"):
        c.contains_n(hash_blocks(NS, np.arange(16)))
    c.close()


def test_namespaces_of_one_model_have_their_own_metrics_labels(make_daemon):
    """Two namespaces of one model that differ only in shape: every per-tier sample is its
    own (one label each, not duplicate samples in one family)."""
    import dataclasses
    wide = dataclasses.replace(NS, head_dim=2 * NS.head_dim)
    d = make_daemon()
    for ns in (NS, wide):
        with Client(d.url, namespace=ns, use_shm=False) as c:
            hs = hash_blocks(ns, np.arange(16))
            c.put_n(hs, np.zeros((1, ns.block_bytes), np.uint8))
    with urllib.request.urlopen(d.http + "/metrics", timeout=5) as r:
        used = [line for line in r.read().decode().splitlines()
                if line.startswith("kvtier_tier_used_blocks{") and 'tier="dram"' in line]
    assert len(used) == 2 and len(set(line.split("}")[0] for line in used)) == 2, used
    assert all(NS.model in line for line in used)


def test_metrics_admin_and_config_file(make_daemon, tmp_path):
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text('[serve]\nquota_blocks = 50\nnode_id = "node-a"\n[quotas]\nteam = 20\n')
    d = make_daemon("--config", str(cfg))
    with Client(d.url, namespace=NS) as c:
        hs = hash_blocks(NS, np.arange(10 * 16))
        c.put_n(hs, blocks(hs))
        c.get_n(hs, np.zeros((10, BB), np.uint8))
        assert c.stats().tier(TierKind.DRAM).capacity_blocks == 50  # the quota caps each tier
    with urllib.request.urlopen(d.http + "/metrics", timeout=5) as r:
        text = r.read().decode()
    for name in ("kvtier_ops_total", "kvtier_op_seconds_bucket", "kvtier_tier_hits_total",
                 "kvtier_tier_demotions_out_total", "kvtier_connections", "kvtier_net_bytes_total", "kvtier_lease_hits_total"):
        assert name in text, name
    assert d.get_json("/healthz")["node_id"] == "node-a"
    assert d.get_json("/admin/quotas") == {"default_blocks": 50, "tenants": {"team": 20}}
    (ns_row,) = d.get_json("/admin/namespaces")["namespaces"]
    assert ns_row["model"] == NS.model and ns_row["quota_blocks"] == 50
    body = d.get_json("/stats")
    stats = body["namespaces"][0]
    assert stats["hits"] == 10 and 0 <= stats["lease_hits"] <= 10  # leases count as hits
    # what the start built (torch's modules and more) is frozen out of the cyclic GC, whose
    # full passes over it stopped every thread of the daemon for up to ~100 ms
    assert body["process"]["gc_frozen_objects"] > 10_000
    req = urllib.request.Request(f"{d.http}/admin/namespaces/{ns_row['ns_id']}/clear", method="POST")
    urllib.request.urlopen(req, timeout=5).read()
    with Client(d.url, namespace=NS) as c:
        assert c.contains_n(hs) == [False] * 10


def test_a_stopped_daemon_is_a_clear_timeout(make_daemon):
    import signal
    import time

    from kvstore.client import RequestTimeout
    d = make_daemon()
    hs = hash_blocks(NS, np.arange(16))
    # the namespace opened (its arena made and faulted in) and the block put by a patient
    # client: the first HELLO, which opens it, took more than 0.5 s on a loaded CI host
    with Client(d.url, namespace=NS, use_shm=False) as patient:
        patient.put_n(hs, blocks(hs))
    with Client(d.url, namespace=NS, timeout_s=0.5, use_shm=False) as c:
        freeze(d.proc.pid)  # (every thread: one polling could serve the GET first)
        try:
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout, match="within 0.5s"):
                c.get_n(hs, np.zeros((1, BB), np.uint8))
            assert time.monotonic() - t0 < 5
        finally:
            d.proc.send_signal(signal.SIGCONT)


def test_echo_gets_the_daemon_output_as_it_comes(make_daemon):
    echo = io.StringIO()
    d = make_daemon(echo=echo)
    assert f"data plane {d.url}" in echo.getvalue()
    assert echo.getvalue() in d.output()


def test_an_ipv6_daemon_prints_urls_a_client_and_curl_can_use(make_daemon):
    """`--host ::1`: the printed URLs put the address in brackets (`kvtier://::1:PORT` was
    printed before, which no URL parser reads as host ::1), and a client and an HTTP client
    given them exactly as printed reach the daemon, its transfer agent too."""
    import socket
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError as e:
        pytest.skip(f"this host has no IPv6 loopback ({e})")
    d = make_daemon("--host", "::1")
    assert d.url == f"kvtier://[::1]:{d.port}"
    assert f"data plane kvtier://[::1]:{d.port}  control http://[::1]:{d.http_port}" in d.output()
    hint = f"kvstore.Client('kvtier://[::1]:{d.port}'"  # a later line: the thread reading
    deadline = time.monotonic() + 10  # the daemon's output may not have it yet
    while hint not in d.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hint in d.output(), d.output()
    with urllib.request.urlopen(f"{d.http}/healthz", timeout=10) as r:
        assert r.status == 200
    hs = hash_blocks(NS, np.arange(2 * 16))
    with Client(d.url, namespace=NS, use_shm=False) as tcp, Client(d.url, namespace=NS) as c, \
            Client(d.url, namespace=NS, use_shm=False, use_agent=True, inline_put_bytes=0,
                   inline_get_bytes=0) as agent:
        tcp.put_n(hs, blocks(hs))
        for client in (tcp, c, agent):
            dst = np.zeros((2, BB), np.uint8)
            assert None not in client.get_n(hs, dst) and (dst == blocks(hs)).all()


def test_an_unusable_data_dir_is_refused_at_start(make_daemon, tmp_path):
    """A second daemon on a data dir, a regular file, or a dangling symlink: `kvtier serve`
    exits 2 saying why, instead of starting and answering "unavailable" to every client."""
    from .conftest import Daemon
    first = make_daemon(data_dir=str(tmp_path / "shared"))
    second = Daemon(str(tmp_path / "shared"))
    with pytest.raises(RuntimeError, match="another kvtier serve is using"):
        second.start(timeout_s=30)
    assert second.proc.wait(10) == 2
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "at-all")
    for bad in ("file", "dangling"):
        d = Daemon(str(tmp_path / bad))
        with pytest.raises(RuntimeError, match="cannot be used"):
            d.start(timeout_s=30)
    assert first.stop() == 0
    restarted = make_daemon(data_dir=str(tmp_path / "shared"))  # the lock went with the first
    with Client(restarted.url, namespace=NS, use_shm=False) as c:
        assert c.contains_n(hash_blocks(NS, np.arange(16))) == [False]
