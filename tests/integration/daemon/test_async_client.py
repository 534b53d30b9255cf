"""The asyncio SDK against a real daemon: the same op suite as `Client` on each path it
takes (same host with and without the put channel, TCP), checked against a dict model,
with no thread started; concurrency, cancellation, a restarted daemon, a silent peer.
Each on asyncio's own event loop and on uvloop's (what vLLM's and SGLang's servers run)."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading

import numpy as np
import pytest
import torch
import uvloop

from kvstore import AsyncClient, Client
from kvstore import wire as w
from kvstore.client import ConnectError, RequestTimeout
from kvstore.daemon.process import freeze
from kvstore.events import TierKind
from kvstore.keys import hash_blocks
from kvstore.store import PutStatus

from kvstore.client import putpath

from .conftest import NS, block_of, op_count

BB = NS.block_bytes
PATHS = {  # name -> AsyncClient options, and the transport it must end up on
    "shm": (dict(), "shm"),
    "staged": (dict(direct_puts=False), "shm"),
    "reserve": (dict(direct_puts=False, staged_put_bytes=0), "shm"),
    "tcp": (dict(use_shm=False), "tcp"),
}


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    """Runs a coroutine to completion on a fresh event loop of either kind."""
    return asyncio.run if request.param == "asyncio" else uvloop.run


def chain(seed: int, n: int) -> list[bytes]:
    return hash_blocks(NS, np.arange(n * NS.block_tokens) + seed * 3_000_017)


def blocks(hs) -> np.ndarray:
    return np.stack([block_of(h, BB) for h in hs])


@pytest.mark.parametrize("path", list(PATHS))
def test_the_op_suite_matches_a_dict_model_on_every_path(make_daemon, path, run):
    opts, transport = PATHS[path]
    d = make_daemon("--dram-size", "1MiB")
    model: dict[bytes, np.ndarray] = {}
    seed = 10 + list(PATHS).index(path)
    threads = threading.active_count()

    async def main():
        async with AsyncClient(d.url, namespace=NS, **opts) as c:
            assert c.transport == transport
            hs = chain(seed, 40)
            # a batch put as one buffer, then per-block buffers of several kinds
            assert await c.put_n(hs[:20], blocks(hs[:20])) == [PutStatus.STORED] * 20
            model.update(zip(hs[:20], blocks(hs[:20])))
            srcs = [torch.from_numpy(block_of(h, BB)) for h in hs[20:30]]
            st = await c.put_n(hs[18:30], [block_of(h, BB) for h in hs[18:20]] + srcs)
            assert st == [PutStatus.EXISTS] * 2 + [PutStatus.STORED] * 10
            model.update((h, block_of(h, BB)) for h in hs[20:30])
            assert await c.put(hs[30], bytearray(block_of(hs[30], BB))) is PutStatus.STORED
            model[hs[30]] = block_of(hs[30], BB)

            # reads: a batch with holes, each hit byte-exact, misses None
            ask = hs[25:35]
            out = np.full((len(ask), BB), 7, np.uint8)
            tiers = await c.get_n(ask, out)
            for h, t, row in zip(ask, tiers, out):
                assert (t is not None) == (h in model)
                if h in model:
                    assert np.array_equal(row, model[h])
            assert await c.contains_n(ask) == [h in model for h in ask]
            m = await c.match_prefix(hs)
            assert m.num_blocks == 31 and len(m.tiers) == 31
            pre = np.zeros((40, BB), np.uint8)
            got = await c.get_prefix_n(hs, pre)
            assert got.num_blocks == 31 and np.array_equal(pre[:31], blocks(hs[:31]))
            assert not pre[31:].any(), "blocks past the prefix were written"
            assert await c.get(hs[3]) == model[hs[3]].tobytes()
            assert await c.get(hs[39]) is None
            t = torch.zeros(BB, dtype=torch.uint8)
            assert await c.get_into(hs[4], t) is not None and bytes(t.numpy()) == model[hs[4]].tobytes()

            # pins, removal, stats
            assert await c.pin_n(hs[:2] + hs[39:]) == [True, True, False]
            await c.unpin_n(hs[:2])
            assert await c.remove_n(hs[:5] + hs[39:]) == 5
            for h in hs[:5]:
                model.pop(h)
            assert await c.contains_n(hs[:6]) == [False] * 5 + [True]
            assert not await c.remove(hs[0])
            s = await c.stats()
            # (a put channel's granted slots count as used until it puts into them)
            assert s.block_bytes == BB and s.tiers[0].used_blocks >= len(model)
            assert await c.contains_n(hs) == [h in model for h in hs]
            assert threading.active_count() == threads, "the asyncio client started a thread"

    run(main())
    # the blocking client (another process would do) sees exactly the model
    with Client(d.url, namespace=NS, use_shm=False) as sync:
        hs = list(model)
        out = np.zeros((len(hs), BB), np.uint8)
        assert None not in sync.get_n(hs, out)
        assert all(np.array_equal(out[i], model[h]) for i, h in enumerate(hs))


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_many_concurrent_calls_on_a_small_pool(make_daemon, path, run):
    d = make_daemon("--dram-size", "2MiB")
    opts, _ = PATHS[path]
    hs = chain(30, 256)

    async def worker(c, k):
        mine = hs[k * 8:(k + 1) * 8]
        assert await c.put_n(mine, blocks(mine)) == [PutStatus.STORED] * 8
        out = np.zeros((8, BB), np.uint8)
        for _ in range(3):
            assert None not in await c.get_n(mine, out)
            assert np.array_equal(out, blocks(mine))

    async def main():
        async with AsyncClient(d.url, namespace=NS, pool_size=2, **opts) as c:
            await asyncio.gather(*(worker(c, k) for k in range(32)))
            assert len(c._idle) <= 2

    run(main())


def test_only_a_lone_call_polls_for_its_reply(make_daemon, run, monkeypatch):
    """Polling holds the event loop: a connection polls (spin_us) while its call is the
    client's only one, and never while others are in flight."""
    from transfer import sockio
    d = make_daemon()
    hs = chain(7, 16)
    polls: list[int] = []
    client: list[AsyncClient] = []
    real = sockio.Spin.poll

    def poll(self, sock, view):
        polls.append(len(client[0]._busy))
        return real(self, sock, view)
    monkeypatch.setattr(sockio.Spin, "poll", poll)

    async def main():
        async with AsyncClient(d.url, namespace=NS, use_shm=False) as c:
            client.append(c)
            await c.put_n(hs, blocks(hs))
            one = np.zeros((1, BB), np.uint8)
            # the daemon stopped for a moment: the reply cannot be there before the first
            # receive (on a loaded host 50 replies in a row had been, and none was waited for)
            freeze(d.pid)
            threading.Timer(0.05, os.kill, (d.pid, signal.SIGCONT)).start()
            await c.get_n(hs[:1], one)
            alone = len(polls)
            out = np.zeros((16, BB), np.uint8)
            await asyncio.gather(*(c.get_n(hs[k:k + 1], out[k:k + 1]) for k in range(16)))
            assert np.array_equal(out, blocks(hs))
            return alone

    assert run(main()) > 0  # a lone call polled
    assert polls and set(polls) == {1}  # and no call polled beside another


def test_payloads_bigger_than_the_socket_buffers(make_daemon, run):
    """Megabytes inline over TCP: many partial sends and receives on the loop."""
    d = make_daemon("--dram-size", "64MiB")
    hs = chain(40, 2048)  # 8 MiB of 4 KiB blocks in one request each way

    async def main():
        async with AsyncClient(d.url, namespace=NS, use_shm=False) as c:
            assert await c.put_n(hs, blocks(hs)) == [PutStatus.STORED] * len(hs)
            out = np.zeros((len(hs), BB), np.uint8)
            assert None not in await c.get_n(hs, out)
            assert np.array_equal(out, blocks(hs))

    run(main())


def test_a_cancelled_call_leaves_no_broken_connection(make_daemon, run):
    d = make_daemon("--dram-size", "64MiB")
    hs = chain(50, 2048)

    async def main():
        async with AsyncClient(d.url, namespace=NS, use_shm=False, pool_size=1) as c:
            await c.put_n(hs, blocks(hs))
            for delay in (0, 0.0005, 0.002):
                task = asyncio.ensure_future(c.get_n(hs, np.zeros((len(hs), BB), np.uint8)))
                await asyncio.sleep(delay)
                task.cancel()
                if delay == 0:  # cancelled before it ran
                    with pytest.raises(asyncio.CancelledError):
                        await task
                else:  # cancelled mid-reply, or (a fast host) already done: either is fine
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                out = np.zeros((4, BB), np.uint8)  # the next call reads its own reply
                assert None not in await c.get_n(hs[:4], out)
                assert np.array_equal(out, blocks(hs[:4]))

    run(main())


def test_a_call_connecting_while_another_task_closes_the_client_does_not_revive_it(make_daemon,
                                                                                   run):
    """close() by another task while a call was connecting (awaiting its HELLO): the call
    mapped the arena again after close() had let it go, and reads after it went on from
    that mapping with no request, never told the client was closed."""
    d = make_daemon()
    hs = chain(55, 4)

    async def main():
        c = await AsyncClient(d.url, namespace=NS).connect()
        await c.put_n(hs, blocks(hs))
        assert c.uses_shm
        open_ = c._open

        async def closed_meanwhile(addr):
            await c.close()  # (another task's close(), at this moment)
            return await open_(addr)
        c._open = closed_meanwhile
        async with c._conn():  # (the pooled connection busy: the call below connects anew)
            with pytest.raises(ConnectError):
                await c.contains_n(hs)
        assert not c.uses_shm
        with pytest.raises(ConnectError):
            await c.get_n(hs, np.zeros((len(hs), BB), np.uint8))

    run(main())


def test_a_restarted_daemon_is_reached_on_a_fresh_connection(make_daemon, run):
    d = make_daemon()
    async def main():
        for k, opts in enumerate((dict(), dict(use_shm=False))):
            hs = chain(60 + k, 6)
            async with AsyncClient(d.url, namespace=NS, **opts) as c:
                await c.put_n(hs[:3], blocks(hs[:3]))
                assert await c.contains_n(hs[:3]) == [True] * 3
                d.stop()
                d.start()  # same port, new arena and local socket
                assert await c.put_n(hs[3:], blocks(hs[3:])) == [PutStatus.STORED] * 3
                out = np.zeros((3, BB), np.uint8)
                assert await c.get_n(hs[3:], out) == [TierKind.DRAM] * 3
                assert np.array_equal(out, blocks(hs[3:]))

    run(main())


def test_wrong_token_unreachable_daemon_and_silent_peer(make_daemon, tmp_path, run):
    (tmp_path / "tokens").write_text("s3cret\n")
    d = make_daemon("--token-file", str(tmp_path / "tokens"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts (the kernel's backlog) and never answers

    async def main():
        with pytest.raises(w.AuthError):
            await AsyncClient(d.url, "wrong", namespace=NS).connect()
        async with AsyncClient(d.url, "s3cret", namespace=NS) as c:
            assert c.uses_shm
        with pytest.raises(ConnectError, match="kvtier serve"):
            await AsyncClient(f"kvtier://127.0.0.1:{free}", namespace=NS).connect()
        port = silent.getsockname()[1]
        with pytest.raises(RequestTimeout, match="HELLO"):
            await AsyncClient(f"kvtier://127.0.0.1:{port}", namespace=NS,
                              timeout_s=0.5).connect()
        with pytest.raises(ValueError, match="namespace"):
            AsyncClient(d.url)

    try:
        run(main())
    finally:
        silent.close()


def test_same_host_calls_answered_without_a_request_still_let_other_tasks_run(make_daemon, run):
    """Reads the slot directory shows in DRAM and puts through the put channel send no
    request: a task looping over them had never given the event loop back, and every other
    task of the process (other clients' streams, a server's handlers) stood still."""
    d = make_daemon("--dram-size", "1MiB")

    async def main():
        ticks = 0

        async def other():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)
        async with AsyncClient(d.url, namespace=NS) as c:
            hs = chain(77, 4)
            assert await c.put_n(hs, blocks(hs)) == [PutStatus.STORED] * 4
            out = np.zeros((4, BB), np.uint8)
            assert None not in await c.get_n(hs, out)  # (all DRAM hits from here on)
            task = asyncio.ensure_future(other())
            await asyncio.sleep(0)
            for _ in range(50):
                assert None not in await c.get_n(hs, out)
                assert (await c.get_prefix_n(hs, out)).num_blocks == 4
            got, ticks = ticks, 0
            more = chain(78, 50)
            for i in range(50):
                await c.put_n(more[i:i + 1], blocks(more[i:i + 1]))
            put_ticks = ticks
            task.cancel()
            return c.transport, got, put_ticks
    transport, get_ticks, put_ticks = run(main())
    assert transport == "shm"
    assert get_ticks >= 50 and put_ticks >= 25, (get_ticks, put_ticks)


def test_a_single_tensor_put_is_copied_by_address(make_daemon, run, monkeypatch):
    """A one-block put of a CPU tensor on the daemon's host goes the way Client's does: its
    bytes copied from the tensor's address into a granted slot (no numpy view or rows made,
    no request); a tensor of the wrong size, a short hash and other buffers are checked as
    ever; every block reads back as put."""
    d = make_daemon("--dram-size", "1MiB")
    by_address = []
    at = putpath.copy_at
    monkeypatch.setattr(putpath, "copy_at", lambda *a, **k: by_address.append(1) or at(*a, **k))

    async def main():
        async with AsyncClient(d.url, namespace=NS) as c:
            first = chain(81, 1)
            assert await c.put_n(first, blocks(first)) == [PutStatus.STORED]  # opens the channel
            puts_before = op_count(d, "put")
            hs = chain(82, 4)
            data = blocks(hs)
            sources = [torch.from_numpy(data[0].copy()),
                       torch.from_numpy(data[1].copy()).view(torch.float16).reshape(2, -1),
                       data[2], memoryview(data[3].copy())]
            for h, src in zip(hs, sources):
                assert await c.put_n([h], src) == [PutStatus.STORED]
            with pytest.raises(ValueError):  # a tensor one byte short: not by address
                await c.put_n(chain(83, 1), torch.zeros(BB - 1, dtype=torch.uint8))
            with pytest.raises(ValueError, match="16 bytes"):
                await c.put_n([hs[0][:15]], torch.from_numpy(data[0].copy()))
            assert op_count(d, "put") == puts_before, "a single-block put sent a PUT"
            out = np.zeros((4, BB), np.uint8)
            assert await c.get_n(hs, out) == [TierKind.DRAM] * 4
            return out, data
    out, data = run(main())
    assert np.array_equal(out, data)
    assert len(by_address) == 2, "the tensors' blocks were not copied by address"
