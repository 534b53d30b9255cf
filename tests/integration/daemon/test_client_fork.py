"""A client made before os.fork() and used on both sides of it: each process gets its own
blocks' bytes and stores its own blocks (kvstore.client.forks). Shared, parent and child
read each other's replies on one pooled connection (a get handed back another block's
bytes) and took the same grants from one put ring (blocks stored under the wrong hash)."""
from __future__ import annotations

import asyncio
import os

import numpy as np

from kvstore import AsyncClient, Client
from kvstore.keys import hash_blocks

from .conftest import NS, block_of

BB = NS.block_bytes


def _in_both(body) -> None:
    """Run body(is_child) in a forked child and in this process at once; the child's
    failure (an exception or a False) fails the test."""
    pid = os.fork()
    if pid == 0:
        try:
            ok = body(True)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit code
            os._exit(2)
        os._exit(0 if ok else 1)
    try:
        assert body(False)
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's reads or puts went wrong"


def _exact(got, dst, src) -> bool:
    return None not in got and all((dst[j] == src[j]).all() for j in range(len(src)))


def test_a_forked_child_and_its_parent_each_get_their_own_blocks(daemon):
    hs = hash_blocks(NS, np.arange(16 * 16) + 4242)
    src = np.stack([block_of(h, BB) for h in hs])
    with Client(daemon.url, namespace=NS, use_shm=False, pool_size=1) as c:
        c.put_n(hs, src)

        def reads(child: bool) -> bool:
            lo = 0 if child else 8
            dst = np.zeros((8, BB), np.uint8)
            for _ in range(400):
                if not _exact(c.get_n(hs[lo:lo + 8], dst), dst, src[lo:lo + 8]):
                    return False
            return True
        _in_both(reads)
        dst = np.zeros((16, BB), np.uint8)
        assert _exact(c.get_n(hs, dst), dst, src)  # the parent's client goes on as before


def test_a_forked_child_and_its_parent_put_through_their_own_channels(daemon):
    with Client(daemon.url, namespace=NS) as c:
        warm = hash_blocks(NS, np.arange(16) + 777)
        c.put_n(warm, np.stack([block_of(h, BB) for h in warm]))
        assert c._puts is not None  # same host: puts go through the put ring

        def puts(child: bool) -> bool:
            hs = hash_blocks(NS, np.arange(300 * 16) + (10**7 if child else 2 * 10**7))
            for i in range(0, len(hs), 3):
                c.put_n(hs[i:i + 3], np.stack([block_of(h, BB) for h in hs[i:i + 3]]))
            c.contains_n(hs[:1])  # (a request: what the ring holds is committed first)
            return True
        _in_both(puts)
    with Client(daemon.url, namespace=NS, use_shm=False) as v:
        for base in (10**7, 2 * 10**7):
            hs = hash_blocks(NS, np.arange(300 * 16) + base)
            dst = np.zeros((len(hs), BB), np.uint8)
            got = v.get_n(hs, dst)
            hits = [i for i, t in enumerate(got) if t is not None]
            assert len(hits) == len(hs)
            assert all((dst[i] == block_of(hs[i], BB)).all() for i in hits)


def test_a_forked_child_uses_an_async_client_on_its_own_loop(daemon):
    hs = hash_blocks(NS, np.arange(8 * 16) + 999)
    src = np.stack([block_of(h, BB) for h in hs])
    c = AsyncClient(daemon.url, namespace=NS, pool_size=1)
    asyncio.run(c.put_n(hs, src))

    def reads(child: bool) -> bool:
        async def run() -> bool:
            dst = np.zeros((8, BB), np.uint8)
            ok = all([_exact(await c.get_n(hs, dst), dst, src) for _ in range(200)])
            more = hash_blocks(NS, np.arange(4 * 16) + (5 if child else 6) * 10**6)
            await c.put_n(more, np.stack([block_of(h, BB) for h in more]))
            got = await c.get_n(more, dst[:4])
            return ok and _exact(got, dst[:4], [block_of(h, BB) for h in more])
        return asyncio.run(run())
    _in_both(reads)
    asyncio.run(c.close())


def test_an_async_client_moves_to_a_second_event_loop(daemon):
    """Each asyncio.run is a new loop: what the client made on the first (connections, the
    put channel's) is made again on the second; the puts of the first are seen."""
    for use_shm in (True, False):
        hs = hash_blocks(NS, np.arange(4 * 16) + (1 + use_shm) * 3 * 10**6)
        src = np.stack([block_of(h, BB) for h in hs])
        c = AsyncClient(daemon.url, namespace=NS, use_shm=use_shm)
        for k in range(4):
            part = slice(k, k + 1)
            assert asyncio.run(c.put_n(hs[part], src[part]))[0].value in ("stored", "exists")
            dst = np.zeros((k + 1, BB), np.uint8)
            assert _exact(asyncio.run(c.get_n(hs[:k + 1], dst)), dst, src[:k + 1])
            assert asyncio.run(c.contains_n(hs[:k + 1])) == [True] * (k + 1)
        asyncio.run(c.close())


def test_connections_in_use_at_the_fork_close_at_the_daemon_with_the_parents_client(make_daemon):
    """The child kept its copies of the connections other threads of the parent were using
    at the fork: once the parent closed its Client the daemon still saw them open (counted
    against the connection caps, holding what they held) until every child exited."""
    import re
    import threading
    import time
    import urllib.request
    d = make_daemon(dram_size="64MiB", ssd_size="0")

    def connections() -> float:
        text = urllib.request.urlopen(d.http + "/metrics", timeout=5).read().decode()
        return float(re.findall(r"^kvtier_connections (\S+)$", text, re.M)[0])

    hs = hash_blocks(NS, np.arange(32 * 16) + 4711)
    src = np.stack([block_of(h, BB) for h in hs])
    c = Client(d.url, namespace=NS, use_shm=False, pool_size=4)
    c.put_n(hs, src)
    stop, kids = threading.Event(), []

    def reads():
        dst = np.zeros_like(src)
        while not stop.is_set():
            c.get_n(hs, dst)

    readers = [threading.Thread(target=reads) for _ in range(3)]
    for t in readers:
        t.start()
    try:
        time.sleep(0.2)
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                time.sleep(30)  # a long-lived child that never uses the client
                os._exit(0)
            kids.append(pid)
        stop.set()
        for t in readers:
            t.join(30)
        c.close()
        for _ in range(100):
            if connections() == 0:
                break
            time.sleep(0.05)
        assert connections() == 0
    finally:
        stop.set()
        for pid in kids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
