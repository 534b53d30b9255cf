"""The SDK against a daemon that stalls (SIGSTOP), dies and comes back, and against callers
that cancel, race and pass bad batches: every answer still right, every error the one
that says what happened, and no client left broken once the daemon is back."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest

from kvstore import AsyncClient, Client
from kvstore import wire as w
from kvstore.client import ConnectError, RequestTimeout
from kvstore.daemon.process import freeze
from kvstore.keys import Namespace, hash_blocks
from kvstore.slotdir import ALIVE_CHECK_S

from .conftest import block_of

NS = Namespace("recovery", num_layers=1, num_kv_heads=1, head_dim=64)
BB = NS.block_bytes


def chain(seed: int, n: int) -> list[bytes]:
    return hash_blocks(NS, np.arange(n * NS.block_tokens) + seed * 1_000_003)


def blocks(hs) -> np.ndarray:
    return np.stack([block_of(h, BB) for h in hs])


def assert_visible_soon(get, out: np.ndarray, hs) -> None:
    """After a timeout the puts before it are committed once the daemon drains the put
    channel the client dropped (it does as the connection closes): soon, not at once."""
    for _ in range(50):
        if None not in get():
            break
        time.sleep(0.1)
    assert np.array_equal(out, blocks(hs))


def test_a_cancelled_flush_leaves_the_async_put_channel_no_reply_behind(make_daemon):
    """A call cancelled while its FLUSH waited kept the put channel with that reply unread:
    every later FLUSH read the one before's, returning before the daemon had committed
    anything, and gets right after puts missed blocks just put."""
    d = make_daemon(dram_size="64MiB", ssd_size="0")

    async def main() -> None:
        hs = chain(1, 61)
        async with AsyncClient(d.url, namespace=NS) as c:
            await c.put_n(hs[:1], blocks(hs[:1]))
            assert c.uses_shm
            freeze(d.pid)
            try:
                await c.put_n(hs[1:2], blocks(hs[1:2]))  # published in the ring, no request
                task = asyncio.ensure_future(c.get_n(hs[:2], np.zeros((2, BB), np.uint8)))
                await asyncio.sleep(0.1)  # its FLUSH waits for the stopped daemon
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                os.kill(d.pid, signal.SIGCONT)
            await asyncio.sleep(0.2)  # (the old channel's FLUSH reply comes meanwhile)
            misses = 0
            for i in range(2, 61):
                await c.put_n(hs[i:i + 1], blocks(hs[i:i + 1]))
                out = np.zeros((1, BB), np.uint8)
                misses += (await c.get_n(hs[i:i + 1], out))[0] is None
                assert np.array_equal(out[0], block_of(hs[i], BB)) or misses
            assert misses == 0
            await c.remove_n(hs[2:12])
            assert await c.contains_n(hs[2:12]) == [False] * 10
    asyncio.run(main())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_put_only_client_recovers_once_the_daemon_is_back(make_daemon, kind):
    """With the daemon gone, a put raised TypeError (Client) or AttributeError
    (AsyncClient), and kept raising it after the daemon was back on its port: the put
    channel was reopened at the local address just forgotten."""
    d = make_daemon(dram_size="64MiB", ssd_size="0")
    hs = chain(2, 8)

    def check(got) -> None:
        out = np.zeros((2, BB), np.uint8)
        with Client(d.url, namespace=NS) as reader:
            assert None not in reader.get_n(hs[4:6], out)
        assert np.array_equal(out, blocks(hs[4:6])) and got[0] is not None

    if kind == "sync":
        c = Client(d.url, namespace=NS)
        try:
            c.put_n(hs[:2], blocks(hs[:2]))
            d.kill()
            time.sleep(2 * ALIVE_CHECK_S)  # (till then the slot directory may still serve a
            # read, rightly: its blocks are whole)
            with pytest.raises(ConnectError):
                c.get_n(hs[:2], np.zeros((2, BB), np.uint8))
            with pytest.raises(ConnectError):
                c.put_n(hs[2:4], blocks(hs[2:4]))
            d.start()
            check(c.put_n(hs[4:6], blocks(hs[4:6])))
            c.put_n(hs[6:8], blocks(hs[6:8]))  # the put channel again
            assert None not in c.get_n(hs[6:8], np.zeros((2, BB), np.uint8))
        finally:
            c.close()
        return

    async def main() -> None:
        async with AsyncClient(d.url, namespace=NS) as c:
            await c.put_n(hs[:2], blocks(hs[:2]))
            d.kill()
            time.sleep(2 * ALIVE_CHECK_S)
            with pytest.raises(ConnectError):
                await c.get_n(hs[:2], np.zeros((2, BB), np.uint8))
            with pytest.raises(ConnectError):
                await c.put_n(hs[2:4], blocks(hs[2:4]))
            d.start()
            check(await c.put_n(hs[4:6], blocks(hs[4:6])))
            await c.put_n(hs[6:8], blocks(hs[6:8]))
            assert None not in await c.get_n(hs[6:8], np.zeros((2, BB), np.uint8))
    asyncio.run(main())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stalled_daemon_times_a_read_out_once(make_daemon, kind):
    """With puts waiting in the put channel and the daemon stopped, a get took three
    timeouts to fail: its FLUSH, a second FLUSH as the channel closed, then the GET."""
    d = make_daemon(dram_size="64MiB", ssd_size="0")
    hs = chain(3, 4)
    timeout_s = 1.0
    out = np.zeros((4, BB), np.uint8)

    if kind == "sync":
        with Client(d.url, namespace=NS, timeout_s=timeout_s) as c:
            c.put_n(hs[:2], blocks(hs[:2]))
            freeze(d.pid)
            try:
                c.put_n(hs[2:], blocks(hs[2:]))  # published in the ring, no request
                t0 = time.monotonic()
                with pytest.raises(RequestTimeout):
                    c.get_n(hs, out)
                took = time.monotonic() - t0
            finally:
                os.kill(d.pid, signal.SIGCONT)
            assert_visible_soon(lambda: c.get_n(hs, out), out, hs)
    else:
        async def main() -> float:
            async with AsyncClient(d.url, namespace=NS, timeout_s=timeout_s) as c:
                await c.put_n(hs[:2], blocks(hs[:2]))
                freeze(d.pid)
                try:
                    await c.put_n(hs[2:], blocks(hs[2:]))
                    t0 = time.monotonic()
                    with pytest.raises(RequestTimeout):
                        await c.get_n(hs, out)
                    took = time.monotonic() - t0
                finally:
                    os.kill(d.pid, signal.SIGCONT)
                for _ in range(50):
                    if None not in await c.get_n(hs, out):
                        break
                    await asyncio.sleep(0.1)
                assert np.array_equal(out, blocks(hs))
                return took
        took = asyncio.run(main())
    assert took < 1.8 * timeout_s, took


def test_threads_making_their_first_puts_together_open_one_put_channel(make_daemon):
    """Threads of one fresh Client each opened a put channel of their own; the last one
    was kept, the puts through the others never flushed, and a thread's get missed the
    block it had just put."""
    d = make_daemon(dram_size="64MiB", ssd_size="0")
    for rep in range(10):
        hs = chain(10 + rep, 16)
        misses, errors = [], []
        with Client(d.url, namespace=NS) as c:
            go = threading.Barrier(16)

            def one(i: int) -> None:
                try:
                    go.wait()
                    c.put_n(hs[i:i + 1], blocks(hs[i:i + 1]))
                    out = np.zeros((1, BB), np.uint8)
                    if c.get_n(hs[i:i + 1], out)[0] is None or \
                            not np.array_equal(out[0], block_of(hs[i], BB)):
                        misses.append(i)
                except Exception as e:  # (reported below)
                    errors.append(e)
            threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert not errors and not misses, (errors, misses)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_hashes_of_the_wrong_length_are_refused_even_when_the_lengths_add_up(make_daemon, kind):
    """A 15-byte and a 17-byte hash packed to 32 bytes, and were stored under two keys the
    caller never named."""
    d = make_daemon(dram_size="64MiB", ssd_size="0")
    good = chain(4, 1)[0]
    bad = [good[:15], good + b"x"]
    data = blocks([good, good])

    for opts in ({}, {"use_shm": False}, {"direct_puts": False}):
        if kind == "sync":
            with Client(d.url, namespace=NS, **opts) as c:
                with pytest.raises(ValueError, match="16 bytes each"):
                    c.put_n(bad, data)
                with pytest.raises(ValueError, match="16 bytes each"):
                    c.contains_n(bad)
        else:
            async def main(opts=opts) -> None:
                async with AsyncClient(d.url, namespace=NS, **opts) as c:
                    with pytest.raises(ValueError, match="16 bytes each"):
                        await c.put_n(bad, data)
                    with pytest.raises(ValueError, match="16 bytes each"):
                        await c.contains_n(bad)
            asyncio.run(main())
    with Client(d.url, namespace=NS) as c:  # nothing stored under either key, nor any other
        assert c.contains_n([good[:15] + good[:1], good[1:] + b"x", good]) == [False] * 3


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_batch_past_the_header_limit_is_refused_before_it_is_sent(make_daemon, kind):
    """A request header over the daemon's limit raced the daemon's refusal: a broken
    pipe, a retry sending it all again, and "lost the connection" for a daemon alive."""
    d = make_daemon(dram_size="64MiB", ssd_size="0")
    many = [i.to_bytes(16, "little") for i in range(w.MAX_HEADER_BYTES // 16 + 1000)]
    if kind == "sync":
        with Client(d.url, namespace=NS, use_shm=False) as c:
            for _ in range(3):
                with pytest.raises(w.RemoteError) as e:
                    c.contains_n(many)
                assert e.value.code is w.ErrorCode.TOO_LARGE
            assert c.contains_n(many[:10]) == [False] * 10
        return

    async def main() -> None:
        async with AsyncClient(d.url, namespace=NS, use_shm=False) as c:
            for _ in range(3):
                with pytest.raises(w.RemoteError) as e:
                    await c.contains_n(many)
                assert e.value.code is w.ErrorCode.TOO_LARGE
            assert await c.contains_n(many[:10]) == [False] * 10
    asyncio.run(main())


def test_a_put_channel_ended_by_one_thread_waits_for_a_put_in_another(make_daemon, monkeypatch):
    """A thread whose FLUSH failed ended the put channel (ring, doorbell, connection)
    while another thread was inside a put on it: that put published into a ring no one
    drained, rang a closed doorbell (or whatever file reused its number) and said STORED
    for a block the daemon never got. Ending a channel now waits for its put in flight."""
    import kvstore.client.putpath as putpath
    d = make_daemon(dram_size="64MiB", ssd_size="0")
    hs = chain(6, 2)
    with Client(d.url, namespace=NS) as c:
        c.put_n(hs[:1], blocks(hs[:1]))
        puts = c._puts
        assert puts is not None
        real = putpath.copy_bytes

        def slow(*a, **kw):
            time.sleep(0.3)  # (the put holds the channel this long)
            return real(*a, **kw)
        monkeypatch.setattr(putpath, "copy_bytes", slow)
        got = []
        putter = threading.Thread(target=lambda: got.append(c.put_n(hs[1:], blocks(hs[1:]))))
        putter.start()
        time.sleep(0.1)
        c._drop_puts(flush=False, failed=puts)  # what a failed FLUSH in this thread does
        putter.join()
        monkeypatch.setattr(putpath, "copy_bytes", real)
        assert got and got[0][0] is not None
    with Client(d.url, namespace=NS) as reader:
        assert reader.contains_n(hs[1:]) == [True]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_close_waits_for_one_touch_at_most_while_the_daemon_hangs(make_daemon, kind):
    """Same-host reads need no request, so an application keeps reading while the daemon
    hangs; the TOUCH reports they fall due for each waited timeout_s, one queued behind
    the other, and close() sent them all: 16 reads, 31 s at timeout_s=2. Now one is in
    flight at most, and close() gives up on the rest once one goes unanswered."""
    d = make_daemon(dram_size="64MiB", ssd_size="0")
    hs = chain(7, 200)
    tmo = 1.0

    async def reads_then_close(c) -> float:
        await c.put_n(hs, blocks(hs))
        await c.stats()
        freeze(d.pid)
        out = np.zeros((len(hs), BB), np.uint8)
        for _ in range(12):
            assert None not in await c.get_n(hs, out)  # straight from shared memory
            await asyncio.sleep(0.06)  # (a TOUCH falls due every 50 ms)
        t0 = time.monotonic()
        await c.close()
        return time.monotonic() - t0

    try:
        if kind == "async":
            took = asyncio.run(reads_then_close(AsyncClient(d.url, namespace=NS, timeout_s=tmo)))
        else:
            c = Client(d.url, namespace=NS, timeout_s=tmo)
            c.put_n(hs, blocks(hs))
            c.stats()
            freeze(d.pid)
            out = np.zeros((len(hs), BB), np.uint8)
            for _ in range(12):
                assert None not in c.get_n(hs, out)
                time.sleep(0.06)
            t0 = time.monotonic()
            c.close()
            took = time.monotonic() - t0
    finally:
        os.kill(d.pid, signal.SIGCONT)
    assert took < 3 * tmo + 1, f"close() took {took:.1f}s against a hung daemon (timeout_s={tmo})"


def test_client_timeouts_are_finite_seconds():
    for bad in (float("inf"), float("nan"), "5", None):
        with pytest.raises(ValueError, match="timeout_s is a finite number of seconds"):
            Client("kvtier://127.0.0.1:1", namespace=NS, timeout_s=bad)
        with pytest.raises(ValueError, match="timeout_s is a finite number of seconds"):
            AsyncClient("kvtier://127.0.0.1:1", namespace=NS, connect_timeout_s=bad)


def test_an_async_client_closed_under_its_first_put_says_so(make_daemon):
    """close() while the first put_n opens the put channel: the put raised a bare TypeError
    (the channel was opened on the closed client's unmapped arena) and the ring's memory and
    doorbell stayed open in the process."""
    d = make_daemon(dram_size="64MiB", ssd_size="0")
    hs = chain(8, 2)

    async def main() -> list:
        c = AsyncClient(d.url, namespace=NS)
        await c.connect()
        return await asyncio.gather(c.put_n(hs[:1], blocks(hs[:1])), c.close(),
                                    c.put_n(hs[1:], blocks(hs[1:])), return_exceptions=True)

    rings = _put_rings()
    first, _, second = asyncio.run(main())
    for outcome in (first, second):
        assert isinstance(outcome, (list, ConnectError)), repr(outcome)
    assert _put_rings() <= rings


def _put_rings() -> int:
    """How many put rings this process has open."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "kvtier-putring" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # closed meanwhile
    return n


def test_an_async_client_on_a_new_loop_waits_for_its_puts_on_that_loop(make_daemon):
    """A second loop's first call waits until the daemon has committed what the first
    loop put through the put channel; it waited with time.sleep, freezing the new loop for
    up to timeout_s against a hung daemon (asyncio.wait_for(..., 0.3) took 5 s)."""
    d = make_daemon(dram_size="64MiB", ssd_size="0")
    hs = chain(9, 8)
    c = AsyncClient(d.url, namespace=NS, timeout_s=5.0)

    async def first() -> None:
        await c.put_n(hs[:4], blocks(hs[:4]))
        await c.contains_n(hs[:1])
        assert c.uses_shm and c._puts is not None
        freeze(d.pid)
        await c.put_n(hs[4:], blocks(hs[4:]))  # into the ring, nobody drains it

    async def second() -> float:
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.contains_n(hs[:1]), 0.3)
        return time.monotonic() - t0

    try:
        asyncio.run(first())
        took = asyncio.run(second())
    finally:
        os.kill(d.pid, signal.SIGCONT)
    assert took < 2.0, f"the new loop was held {took:.1f}s"
    for _ in range(50):  # once the daemon is back: the channel given up on closed, and the
        if asyncio.run(c.contains_n(hs)) == [True] * len(hs):  # daemon drained it at its
            break  # end (soon, not at once: another of its threads)
        time.sleep(0.1)
    assert asyncio.run(c.contains_n(hs)) == [True] * len(hs)
    asyncio.run(c.close())


@pytest.mark.parametrize("use_shm", [False, True])
def test_close_cuts_a_call_another_thread_has_in_flight(make_daemon, use_shm):
    """close() from another thread while a request waits on a daemon that does not answer
    (SIGSTOP): the call raises ConnectError at once, not after timeout_s, and so does every
    call after; the daemon, back, serves a new client as before. (A FLUSH of the put
    channel in flight is not cut: close flushes that channel itself.)"""
    d = make_daemon(dram_size="4MiB", ssd_size="0")
    hs = chain(40, 2)
    c = Client(d.url, namespace=NS, use_shm=use_shm, timeout_s=60)
    c.put_n(hs[:1], blocks(hs[:1]))
    assert c.contains_n(hs) == [True, False]  # (flushed: the call below sends no FLUSH)
    caught: list[BaseException] = []
    ended = threading.Event()

    def call() -> None:
        try:
            c.contains_n(hs)  # a request on either path: the daemon must answer it
        except BaseException as e:  # noqa: BLE001 (the test looks at what it is)
            caught.append(e)
        ended.set()

    freeze(d.pid)
    closer = threading.Thread(target=c.close)
    try:
        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.3)  # (its request is sent and waits for the stopped daemon)
        assert not ended.is_set()
        closer.start()
        assert ended.wait(10), "close() left the call waiting on the stopped daemon"
        assert len(caught) == 1 and isinstance(caught[0], ConnectError), caught
        with pytest.raises(ConnectError, match="closed"):
            c.contains_n(hs)
    finally:
        os.kill(d.pid, signal.SIGCONT)
    closer.join(30)
    assert not closer.is_alive()
    with Client(d.url, namespace=NS, use_shm=use_shm) as again:
        assert again.contains_n(hs) == [True, False]


@pytest.mark.parametrize("use_shm", [False, True])
def test_an_async_close_cuts_a_request_another_task_has_in_flight(make_daemon, use_shm):
    """AsyncClient.close() while another task's request waits on a stopped daemon: that
    request raises ConnectError at once, as with Client."""
    d = make_daemon(dram_size="4MiB", ssd_size="0")
    hs = chain(41, 2)

    async def main() -> None:
        c = AsyncClient(d.url, namespace=NS, use_shm=use_shm, timeout_s=60)
        await c.put_n(hs[:1], blocks(hs[:1]))
        assert await c.contains_n(hs) == [True, False]  # (flushed: no FLUSH below)
        freeze(d.pid)
        try:
            call = asyncio.ensure_future(c.contains_n(hs))
            await asyncio.sleep(0.3)  # (its request is sent and waits)
            assert not call.done()
            closing = asyncio.ensure_future(c.close())
            done, _ = await asyncio.wait([call], timeout=10)
            assert done, "close() left the request waiting on the stopped daemon"
            with pytest.raises(ConnectError):
                call.result()
            with pytest.raises(ConnectError, match="closed"):
                await c.contains_n(hs)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        await asyncio.wait_for(closing, 30)
        async with AsyncClient(d.url, namespace=NS, use_shm=use_shm) as again:
            assert await again.contains_n(hs) == [True, False]
    asyncio.run(main())
