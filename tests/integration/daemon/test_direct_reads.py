"""Same-host reads with no request: a client copies published DRAM slots of a real daemon.

In the churn test the daemon has 16 DRAM slots of 256 KiB; writers in other processes
churn through far more blocks than that, so slots are reused while readers copy them.
Every block's bytes are derived from its hash (`block_of`), so any wrong byte a reader
accepted would show.
"""
from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np

from kvstore.client import Client
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks

from .conftest import NS, block_of, op_count


BIG = Namespace("test-model-big", num_layers=64, num_kv_heads=1, head_dim=64)  # 256 KiB


def chain(start: int, n: int, ns: Namespace = NS) -> list[bytes]:
    return hash_blocks(ns, np.arange(start * ns.block_tokens, (start + n) * ns.block_tokens))


def test_dram_hits_need_no_request_and_are_counted(make_daemon):
    daemon = make_daemon()
    hashes = chain(0, 8)
    with Client(daemon.url, namespace=NS) as c:
        assert c.uses_shm
        c.put_n(hashes, [block_of(h, NS.block_bytes) for h in hashes])
        gets_before = op_count(daemon, "get")
        out = np.empty((8, NS.block_bytes), np.uint8)
        for _ in range(5):
            assert c.get_n(hashes, out) == [TierKind.DRAM] * 8
            for h, row in zip(hashes, out):
                assert np.array_equal(row, block_of(h, NS.block_bytes))
        assert op_count(daemon, "get") == gets_before, "a DRAM hit on the same host sent a GET"
        hits = c.stats().tiers[0].counters.hits  # stats() reports the pending direct reads
        assert hits == 40
    assert daemon.get_json("/stats")["namespaces"][0]["direct_hits"] == 40


def test_removed_and_evicted_blocks_miss_at_once(make_daemon):
    daemon = make_daemon("--ssd-size", "0")  # DRAM only: eviction drops
    hashes = chain(100, 4)
    with Client(daemon.url, namespace=NS) as reader, Client(daemon.url, namespace=NS) as other:
        reader.put_n(hashes, [block_of(h, NS.block_bytes) for h in hashes])
        buf = np.empty(NS.block_bytes, np.uint8)
        assert reader.get_into(hashes[0], buf) is TierKind.DRAM
        assert other.remove(hashes[0])
        assert reader.get_into(hashes[0], buf) is None
        flood = chain(1000, 128)  # twice the DRAM slots: everything older is evicted
        for i in range(0, 128, 16):
            other.put_n(flood[i:i + 16], [block_of(h, NS.block_bytes) for h in flood[i:i + 16]])
        assert reader.get_n(hashes[1:], np.empty((3, NS.block_bytes), np.uint8)) == [None] * 3


def _churn(url: str, start: int, rounds: int, latest, stop) -> None:
    """Put fresh blocks (and remove some) as fast as possible, cycling every DRAM slot;
    `latest` holds the first block number of the batch just stored."""
    with Client(url, namespace=BIG) as c:
        for r in range(rounds):
            if stop.is_set():
                return
            hs = chain(start + 4 * r, 4, BIG)
            c.put_n(hs, [block_of(h, BIG.block_bytes) for h in hs])
            latest.value = start + 4 * r
            if r % 3 == 0:
                c.remove_n(hs[::2])


def test_readers_never_accept_bytes_of_a_reused_slot(make_daemon, monkeypatch):
    import kvstore.client.shm
    monkeypatch.setattr(kvstore.client.shm, "VECTOR_READS", 4)  # 8-block reads: vectorised
    daemon = make_daemon("--ssd-size", "0", "--dram-size", "4MiB")
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    latest = [ctx.Value("q", -1) for _ in range(2)]
    writers = [ctx.Process(target=_churn, args=(daemon.url, 10_000 * (k + 1), 1500, latest[k],
                                                 stop)) for k in range(2)]
    for p in writers:
        p.start()
    bad, hits, misses = [], [0], [0]

    def read(k: int) -> None:
        # reader 0 asks for both latest batches at once (the vectorised path), reader 1
        # for one batch at a time (block by block)
        n = 8 if k == 0 else 4
        with Client(daemon.url, namespace=BIG) as c:
            out = np.empty((n, BIG.block_bytes), np.uint8)
            while any(p.is_alive() for p in writers):
                # the blocks a writer put most recently: in DRAM now, soon evicted or removed
                for start in (latest[k].value + 4 - n, latest[k].value - 4):
                    if start < 10_000 * (k + 1):
                        continue
                    hs = chain(start, n, BIG)
                    for h, t, row in zip(hs, c.get_n(hs, out), out):
                        if t is None:
                            misses[0] += 1
                        elif not np.array_equal(row, block_of(h, BIG.block_bytes)):
                            bad.append(h.hex())
                        else:
                            hits[0] += 1

    try:
        readers = [threading.Thread(target=read, args=(k,)) for k in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(300)
    finally:
        stop.set()
        for p in writers:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert not bad, f"{len(bad)} blocks read with another block's bytes"
    assert hits[0] > 1000 and misses[0] > 0, (hits, misses)
    assert all(p.exitcode == 0 for p in writers)
    assert daemon.get_json("/stats")["namespaces"][0]["direct_hits"] > 0


def test_async_client_reads_dram_blocks_on_the_loop_and_the_rest_from_the_daemon(make_daemon):
    import asyncio

    from kvstore.client import AsyncClient

    daemon = make_daemon()
    hashes = chain(200, 6)

    async def run() -> None:
        async with AsyncClient(daemon.url, namespace=NS) as c:
            assert c.uses_shm
            await c.put_n(hashes[:4], [block_of(h, NS.block_bytes) for h in hashes[:4]])
            gets = op_count(daemon, "get")
            out = np.zeros((6, NS.block_bytes), np.uint8)
            assert await c.get_n(hashes, out) == [TierKind.DRAM] * 4 + [None, None]
            assert op_count(daemon, "get", gets + 1) == gets + 1, \
                "only the two misses asked the daemon"
            for h, row in zip(hashes[:4], out):
                assert np.array_equal(row, block_of(h, NS.block_bytes))
            assert await c.get(hashes[0]) == block_of(hashes[0], NS.block_bytes).tobytes()
            assert await c.get(hashes[5]) is None
            assert (await c.stats()).tiers[0].counters.hits == 5

    asyncio.run(run())


def test_kvtier_stats_shows_direct_and_leased_hits(make_daemon):
    import subprocess
    import sys

    daemon = make_daemon()
    hashes = chain(300, 2)
    with Client(daemon.url, namespace=NS) as c:
        c.put_n(hashes, [block_of(h, NS.block_bytes) for h in hashes])
        c.get_n(hashes, np.empty((2, NS.block_bytes), np.uint8))
    done = subprocess.run([sys.executable, "-m", "kvtier", "stats", "--url", daemon.http],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "hits=2 misses=0 (same-host direct 2, leased 0)" in done.stdout
    assert "dram  2/64 blocks" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "kvtier", "stats", "--url",
                          f"http://127.0.0.1:{daemon.port}"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "control-plane" in bad.stderr
    # a token with a line break was blamed on the address; a daemon's other JSON (its
    # /healthz) was a KeyError traceback; `| head` a BrokenPipeError one
    for argv, says in ((["--url", daemon.http, "--token", "a\nb"], "line break"),
                       (["--url", daemon.http + "/healthz?"], "not a kvtier daemon's stats")):
        bad = subprocess.run([sys.executable, "-m", "kvtier", "stats", *argv],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and says in bad.stderr and "Traceback" not in bad.stderr
    piped = subprocess.run(f"{sys.executable} -m kvtier stats --url {daemon.http} | head -c1",
                           shell=True, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in piped.stderr


def test_reads_reach_the_daemon_in_few_touches_with_exact_counts(make_daemon, monkeypatch):
    """Direct reads are reported per distinct block with a count: 600 reads of 3 blocks
    cost the daemon a TOUCH or two, its hit counts stay exact, and each TOUCH happens at
    most every TOUCH_EVERY_S or once TOUCH_BATCH distinct blocks wait."""
    import kvstore.client.replies as replies

    daemon = make_daemon()
    hashes = chain(400, 3)
    monkeypatch.setattr(replies, "TOUCH_EVERY_S", 3600.0)  # only the size rule, for now
    with Client(daemon.url, namespace=NS) as c:
        c.put_n(hashes, [block_of(h, NS.block_bytes) for h in hashes])
        touches = op_count(daemon, "touch")
        out = np.empty((3, NS.block_bytes), np.uint8)
        for _ in range(200):
            assert c.get_n(hashes, out) == [TierKind.DRAM] * 3
        assert op_count(daemon, "touch") == touches, "TOUCHes went before any was due"
        monkeypatch.setattr(replies, "TOUCH_BATCH", 3)  # 3 distinct blocks wait: due
        c.get_n(hashes[:1], out[:1])
        assert op_count(daemon, "touch", touches + 1) == touches + 1
        assert c.stats().tiers[0].counters.hits == 601
        hits = daemon.get_json("/stats")["namespaces"][0]["direct_hits"]
        assert hits == 601
        monkeypatch.setattr(replies, "TOUCH_BATCH", 4096)
        monkeypatch.setattr(replies, "TOUCH_EVERY_S", 0.0)  # the time rule: every read
        c.get_n(hashes, out)
        assert op_count(daemon, "touch", touches + 2) == touches + 2
        monkeypatch.setattr(replies, "TOUCH_EVERY_S", 3600.0)
        for _ in range(2):
            c.get_n(hashes, out)
        assert c.remove_n(hashes[1:]) == 2  # before the daemon heard of their reads
        assert c.stats().tiers[0].counters.hits == 604 + 2, "reads of gone blocks counted"
        monkeypatch.setattr(replies, "TOUCH_BATCH", 2)  # a read of more: several TOUCHes
        more = chain(500, 5)
        c.put_n(more, [block_of(h, NS.block_bytes) for h in more])
        touches = op_count(daemon, "touch")
        c.get_n(more, np.empty((5, NS.block_bytes), np.uint8))
        assert c.stats().tiers[0].counters.hits == 606 + 5
        assert op_count(daemon, "touch", touches + 3) == touches + 3  # 2 + 2 + 1 blocks
