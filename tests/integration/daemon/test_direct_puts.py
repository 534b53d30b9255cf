"""Same-host puts with no request (put channels): blocks written into granted DRAM slots,
committed by the daemon from a shared ring. Byte-exact for every reader, visible to the
client's own next request, no slot leaked when a client dies or lies, and no lost put when
the daemon goes away."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore import Client
from kvstore import wire as w
from kvstore.client import putpath
from kvstore.events import TierKind
from kvstore.keys import hash_blocks
from kvstore import putring
from kvstore.putring import PutRing
from kvstore.store import PutStatus
from transfer.shm import ShmSegment

from .conftest import NS, ROOT, block_of, op_count

BB = NS.block_bytes


def chain(seed: int, n: int) -> list[bytes]:
    return hash_blocks(NS, np.arange(n * NS.block_tokens) + seed * 7_000_003)


def blocks(hs):
    return np.stack([block_of(h, BB) for h in hs])


def drained(c: Client, grants: int) -> None:
    """Wait until the daemon's drainer committed c's puts and its channel holds `grants`
    granted slots (it commits after each put, on its own thread, and tops the stock up
    once it has gone down a step: putchannel.TOP_UP_STEP)."""
    t0 = time.monotonic()
    while c._puts.pending() or len(c._puts.grants) + len(c._puts.ring.unclaimed_grants()) \
            < grants:
        assert time.monotonic() - t0 < 10, "the drainer did not commit and grant in 10 s"
        time.sleep(0.005)


def dram_used(daemon) -> int:
    (ns,) = [n for n in daemon.get_json("/stats")["namespaces"] if n["model"] == NS.model]
    return next(t["used_blocks"] for t in ns["tiers"] if t["tier"] == "dram")


def test_puts_send_no_request_and_every_reader_sees_the_bytes(make_daemon):
    daemon = make_daemon("--dram-size", "4MiB")  # 1024 slots: a channel is granted 64
    hs = chain(1, 6)
    with Client(daemon.url, namespace=NS) as c, \
            Client(daemon.url, namespace=NS, use_shm=False) as tcp:
        c.put_n(hs[:1], blocks(hs[:1]))  # opens the put channel
        assert c._puts is not None
        puts_before = op_count(daemon, "put")
        assert c.put_n(hs, blocks(hs)) == [PutStatus.EXISTS] + [PutStatus.STORED] * 5
        assert c.put_n(hs[2:3], blocks(hs[2:3])) == [PutStatus.EXISTS]  # even uncommitted
        assert op_count(daemon, "put") == puts_before, "a direct put sent a PUT"
        assert c.contains_n(hs) == [True] * 6  # its own next request sees them (FLUSH)
        out = np.zeros((6, BB), np.uint8)
        assert tcp.get_n(hs, out) == [TierKind.DRAM] * 6
        assert np.array_equal(out, blocks(hs))


def test_a_single_block_put_takes_any_host_source(make_daemon, monkeypatch):
    """One block at a time (the common same-host put, copied from one numpy view of its
    source): numpy, read-only bytes, torch of any dtype, flat or [1, bytes], each stored
    byte-exact, EXISTS when put again (uncommitted, then committed), and a source of the
    wrong size or a hash of the wrong length refused with nothing published."""
    import torch

    from kvstore.errors import BlockSizeError
    daemon = make_daemon("--dram-size", "4MiB")
    one = putpath.DirectPuts._put_one
    taken = []
    monkeypatch.setattr(putpath.DirectPuts, "_put_one",
                        lambda self, *a: taken.append(1) or one(self, *a))
    by_address = []  # (a CPU tensor's block is copied by its address, no view made)
    at = putpath.copy_at
    monkeypatch.setattr(putpath, "copy_at", lambda *a, **k: by_address.append(1) or at(*a, **k))
    hs = chain(11, 6)
    data = blocks(hs)
    sources = [data[0], bytes(data[1]), torch.from_numpy(data[2].copy()).view(torch.float16),
               torch.from_numpy(data[3:4].copy()), data[4:5], memoryview(data[5].copy())]
    with Client(daemon.url, namespace=NS) as c, \
            Client(daemon.url, namespace=NS, use_shm=False) as tcp:
        c.put_n(chain(12, 1), blocks(chain(12, 1)))  # opens the put channel
        puts_before = op_count(daemon, "put")
        for h, src in zip(hs, sources):
            assert c.put_n([h], src) == [PutStatus.STORED]
            assert c.put_n([h], src) == [PutStatus.EXISTS]  # not committed yet, maybe
        with pytest.raises(BlockSizeError):
            c.put_n(chain(13, 1), data[0][:-1])
        with pytest.raises(ValueError, match="16 bytes"):
            c.put_n([chain(13, 1)[0][:15]], data[0])
        assert c.contains_n(hs) == [True] * 6  # committed (FLUSH): the directory shows them
        assert [c.put_n([h], src)[0] for h, src in zip(hs, sources)] == [PutStatus.EXISTS] * 6
        assert c.put_n(chain(13, 1), data[0]) == [PutStatus.STORED]
        assert op_count(daemon, "put") == puts_before, "a single-block put sent a PUT"
        # (and the put that opened the channel: it takes the channel's first grants itself)
        assert len(taken) == 1 + 6 * 3 + 2, "a single-block put left the one-block path"
        assert len(by_address) == 2, "the two tensors' blocks were not copied by address"
        out = np.zeros((6, BB), np.uint8)
        assert tcp.get_n(hs, out) == [TierKind.DRAM] * 6
        assert np.array_equal(out, data)


def test_a_single_put_takes_the_ring_s_new_grants_when_its_own_run_out(make_daemon,
                                                                        monkeypatch):
    """A single CPU-tensor put whose client has used every slot it took, while the drainer
    has granted more in the ring since, takes those and copies by address: it never went
    the rows path (whose refill had cost such a put ~240 us quiet, one in ~170 back to back,
    and ~4 ms under two busy processes)."""
    import torch
    daemon = make_daemon("--dram-size", "4MiB")  # 1024 slots: a stock of 256
    general = []
    put_n = putpath.DirectPuts.put_n
    monkeypatch.setattr(putpath.DirectPuts, "put_n",
                        lambda self, *a: general.append(1) or put_n(self, *a))
    hs = chain(31, 600)
    data = torch.from_numpy(blocks(hs))
    with Client(daemon.url, namespace=NS) as c:
        c.put_n(chain(32, 1), blocks(chain(32, 1)))  # opens the put channel
        puts = c._puts
        drained(c, 1)
        k = 0
        while puts.grants or not puts.ring.unclaimed_grants():  # its own stock used up,
            assert k < len(hs), "the drainer granted nothing more in 600 puts"  # new in the
            if puts.grants:  # ring
                assert c.put_n(hs[k:k + 1], data[k]) == [PutStatus.STORED]
                k += 1
            else:
                time.sleep(0.005)
        general.clear()
        puts_before = op_count(daemon, "put")
        assert c.put_n(hs[k:k + 1], data[k]) == [PutStatus.STORED]
        assert not general, "the put left the single-block path to refill its grants"
        assert puts.grants or puts.ring.unclaimed_grants() == [], "no grant was taken"
        assert op_count(daemon, "put") == puts_before
        out = torch.zeros(k + 1, BB, dtype=torch.uint8)
        assert None not in c.get_n(hs[:k + 1], out) and torch.equal(out, data[:k + 1])


def test_grants_run_out_and_puts_fall_back_to_a_request(make_daemon):
    d = make_daemon("--dram-size", "64KiB")  # 16 slots: a channel is granted 2
    hs = chain(2, 12)
    with Client(d.url, namespace=NS) as c:
        assert c.put_n(hs, blocks(hs)) == [PutStatus.STORED] * 12
        out = np.zeros((12, BB), np.uint8)
        assert None not in c.get_n(hs, out) and np.array_equal(out, blocks(hs))
    assert op_count(d, "put") >= 1, "12 blocks cannot all have fitted 2 grants"


def test_a_writer_that_came_second_puts_directly_while_the_first_sits_idle(make_daemon):
    """Two same-host clients of one namespace: the first stocks its channel with the whole
    quarter of DRAM the stocks share, then stays open and idle (grants cannot be taken
    back from it); the second still gets its part, and every one of its puts goes with no
    request (they all went by request, ~10x slower, until the first closed)."""
    d = make_daemon(dram_size="4MiB", ssd_size="0")  # 1024 slots: a lone channel gets 256
    first, second = chain(21, 1), chain(22, 40)
    with Client(d.url, namespace=NS) as idle, Client(d.url, namespace=NS) as c:
        idle.put_n(first, blocks(first))  # opens its channel: stocked with 256
        drained(idle, 255)  # (one put since: no top-up for one slot)
        c.put_n(second[:1], blocks(second[:1]))  # opens the second channel
        puts_before = op_count(d, "put")
        for i in range(1, len(second)):
            assert c.put_n(second[i:i + 1], blocks(second[i:i + 1])) == [PutStatus.STORED]
        assert op_count(d, "put") == puts_before, "the second writer's puts sent PUTs"
        out = np.zeros((len(second), BB), np.uint8)
        assert c.get_n(second, out) == [TierKind.DRAM] * len(second)
        assert np.array_equal(out, blocks(second))


def test_a_full_dram_only_arena_keeps_granting(make_daemon):
    """With DRAM the only tier, room is made by dropping its oldest blocks: the grants keep
    coming once the arena is full, so puts never fall back to a request (they used to, for
    every put after the first arena-full, at ~10x the cost)."""
    d = make_daemon(dram_size="256KiB", ssd_size="0")  # 64 slots: a channel is granted 16
    hs = chain(8, 400)
    with Client(d.url, namespace=NS) as c:
        c.put_n(hs[:1], blocks(hs[:1]))  # opens the put channel
        puts_before = op_count(d, "put")
        for i in range(1, len(hs)):
            assert c.put_n(hs[i:i + 1], blocks(hs[i:i + 1])) == [PutStatus.STORED]
        assert op_count(d, "put") == puts_before, "a put into a full arena sent a PUT"
        tail = hs[-8:]
        out = np.zeros((8, BB), np.uint8)
        assert c.get_n(tail, out) == [TierKind.DRAM] * 8 and np.array_equal(out, blocks(tail))
        assert c.contains_n(hs[:8]) == [False] * 8  # the oldest made the room
    assert dram_used(d) <= 64


def test_a_batch_bigger_than_the_stock_takes_one_flush_not_a_put(make_daemon, monkeypatch):
    """A channel keeps 16 slots in stock here; a batch of 24 asks for its slots with one
    FLUSH (no reserve and commit). A batch the daemon cannot grant goes by request, and the
    client does not ask again for a batch that big for a while."""
    d = make_daemon(dram_size="256KiB", ssd_size="0")  # 64 slots: a stock of 16
    with Client(d.url, namespace=NS) as c, Client(d.url, namespace=NS) as other:
        c.put_n(chain(20, 1), blocks(chain(20, 1)))  # opens the put channel
        ops = {op: op_count(d, op) for op in ("put", "reserve", "flush")}
        hs = chain(21, 24)
        assert c.put_n(hs, blocks(hs)) == [PutStatus.STORED] * 24
        assert op_count(d, "put") == ops["put"] and op_count(d, "reserve") == ops["reserve"]
        assert op_count(d, "flush", ops["flush"] + 1) == ops["flush"] + 1
        drained(c, 32)  # two batches of 24 would be 48: the half of the arena is 32
        out = np.zeros((24, BB), np.uint8)
        assert other.get_n(hs, out) == [TierKind.DRAM] * 24  # committed: any reader sees them
        assert np.array_equal(out, blocks(hs))
        # a second channel: c, putting batches of 24, holds the half of the arena that
        # grants may take, so this one is granted nothing: not enough for 30
        monkeypatch.setattr(putpath, "REFUSED_RETRY_S", 0.0)  # its first (1 block) falls short
        ops = {op: op_count(d, op) for op in ("put", "flush")}
        other.put_n(chain(22, 1), blocks(chain(22, 1)))  # a FLUSH that fell short, a PUT
        ops = {op: op_count(d, op, ops[op] + 1) for op in ("put", "flush")}
        big = chain(23, 30)
        assert other.put_n(big, blocks(big)) == [PutStatus.STORED] * 30  # by request
        assert op_count(d, "put", ops["put"] + 1) == ops["put"] + 1
        assert op_count(d, "flush", ops["flush"] + 1) == ops["flush"] + 1
        monkeypatch.setattr(putpath, "REFUSED_RETRY_S", 3600.0)
        again = chain(24, 30)
        assert other.put_n(again, blocks(again)) == [PutStatus.STORED] * 30
        assert op_count(d, "flush") == ops["flush"] + 1, "asked again at once for a batch refused"
        out = np.zeros((30, BB), np.uint8)
        assert c.get_n(again, out) == [TierKind.DRAM] * 30
        assert np.array_equal(out, blocks(again))


def test_batches_bigger_than_the_stock_go_on_without_a_flush(make_daemon):
    """Only the first batch bigger than the stock (16 here) takes a FLUSH: while the client
    keeps putting batches that big, the drainer keeps two of them granted (up to half the
    arena), and each next put finds its slots."""
    d = make_daemon(dram_size="256KiB", ssd_size="0")  # 64 slots: a stock of 16
    with Client(d.url, namespace=NS) as c:
        c.put_n(chain(30, 1), blocks(chain(30, 1)))  # opens the put channel
        flushes = op_count(d, "flush")
        for k in range(5):
            hs = chain(31 + k, 24)
            assert c.put_n(hs, blocks(hs)) == [PutStatus.STORED] * 24
            drained(c, 32)  # committed, and two batches granted (the half of the arena)
        assert op_count(d, "flush", flushes + 1) == flushes + 1
        out = np.zeros((24, BB), np.uint8)
        assert c.get_n(hs, out) == [TierKind.DRAM] * 24 and np.array_equal(out, blocks(hs))


KILLED_WRITER = """
import os, sys, numpy as np
from kvstore import Client
from kvstore.keys import Namespace, hash_blocks
ns = Namespace("test-model", num_layers=1, num_kv_heads=1, head_dim=64)
c = Client(sys.argv[1], namespace=ns)
hs = hash_blocks(ns, np.arange(3 * 16) + 99)
c.put_n(hs, np.full((3, ns.block_bytes), 5, np.uint8))
print(len(c._puts.grants), flush=True)
os.kill(os.getpid(), 9)  # holding granted slots, some never committed
"""


def test_a_killed_writer_leaks_no_granted_slot(make_daemon):
    d = make_daemon("--dram-size", "64KiB")
    with Client(d.url, namespace=NS, use_shm=False) as c:
        c.contains_n(chain(3, 1))  # the namespace exists
    out = subprocess.run([sys.executable, "-c", KILLED_WRITER, d.url], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == -9 and out.stdout.strip(), out.stderr
    deadline = time.monotonic() + 10
    while dram_used(d) != 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dram_used(d) == 3, "granted slots outlived their channel"
    hs = chain(4, 13)  # every other slot can be used again
    with Client(d.url, namespace=NS, direct_puts=False) as c:
        assert c.put_n(hs, blocks(hs)).count(PutStatus.STORED) == 13


@contextlib.contextmanager
def raw_channel(daemon):
    """A put channel opened by hand on a local connection, as a hostile client would:
    (its connection, its ring, its doorbell), closed after."""
    with Client(daemon.url, namespace=NS, use_shm=False) as probe:
        name = probe._run(lambda conn: conn.info.local_socket)
    from kvstore.client.conn import Connection, LocalAddress
    conn = Connection(LocalAddress(name), "", NS, 5, 5)
    reply, (ring_fd, bell) = conn.call_fds(w.Puts(), 2)
    seg = ShmSegment.from_fd(ring_fd, writable=True)
    try:
        yield conn, PutRing(seg.array), bell
    finally:
        conn.close()
        seg.close()
        os.close(bell)


def test_a_ring_naming_slots_it_was_not_granted_commits_nothing(daemon):
    with raw_channel(daemon) as (conn, ring, _):
        granted = set(ring.take_grants(ring.grant_capacity))
        stranger = next(s for s in range(10_000) if s not in granted)
        hs = chain(5, 2)
        ring.push(hs, [stranger, stranger + 1 if stranger + 1 not in granted else stranger])
        conn.call(w.Flush())
        with Client(daemon.url, namespace=NS, use_shm=False) as c:
            assert c.contains_n(hs) == [False, False]


def test_a_daemon_restart_loses_no_acknowledged_put(make_daemon):
    d = make_daemon()
    hs = chain(6, 8)
    with Client(d.url, namespace=NS) as c:
        c.put_n(hs[:4], blocks(hs[:4]))
        assert c.contains_n(hs[:4]) == [True] * 4
        d.stop()
        d.start()  # same port; its arena, directory and channels are new
        assert c.put_n(hs[4:], blocks(hs[4:])) == [PutStatus.STORED] * 4
        out = np.zeros((4, BB), np.uint8)
        assert c.get_n(hs[4:], out) == [TierKind.DRAM] * 4 and np.array_equal(out, blocks(hs[4:]))


def test_a_quiet_put_channel_outlives_the_idle_timeout(make_daemon):
    d = make_daemon("--idle-timeout", "1")
    hs = chain(7, 4)
    with Client(d.url, namespace=NS) as c:
        c.put_n(hs[:2], blocks(hs[:2]))
        puts = c._puts
        time.sleep(2)  # longer than the idle timeout: the channel must still hold its grants
        assert c.put_n(hs[2:], blocks(hs[2:])) == [PutStatus.STORED] * 2 and c._puts is puts
        out = np.zeros((4, BB), np.uint8)
        assert c.get_n(hs, out) == [TierKind.DRAM] * 4 and np.array_equal(out, blocks(hs))


def test_the_drainer_and_maintenance_run_as_background_threads(make_daemon):
    """The drainer's doorbell wakes it once per put: as a normal thread it preempted the
    putting client mid-copy on a busy host; as SCHED_BATCH it waits for its turn instead.
    Every other thread (connections, acceptors) stays a normal one."""
    daemon = make_daemon("--dram-size", "4MiB")
    with Client(daemon.url, namespace=NS) as c:
        hs = chain(31, 2)
        c.put_n(hs, blocks(hs))
        policies = {}
        for tid in os.listdir(f"/proc/{daemon.pid}/task"):
            with open(f"/proc/{daemon.pid}/task/{tid}/comm") as f:
                policies.setdefault(f.read().strip(), []).append(os.sched_getscheduler(int(tid)))
        assert c.contains_n(hs) == [True, True]
    assert policies.pop("kvtier-puts") == [os.SCHED_BATCH]
    assert policies.pop("kvtier-maintain") == [os.SCHED_BATCH]  # the namespace's store
    assert all(p == os.SCHED_OTHER for ps in policies.values() for p in ps), policies


@pytest.mark.parametrize("after_s", [0.2, 0.5])
def test_a_daemon_killed_mid_put_is_an_sdk_error_not_a_socket_error(make_daemon, after_s):
    """SIGKILL while a client streams same-host puts: put_n raises the SDK's own error
    (KVStoreError: ConnectError), which callers catch. A FLUSH to the dead daemon (the put
    channel asking for grants) let a bare ConnectionResetError out."""
    import signal
    import threading

    from kvstore.errors import KVStoreError
    d = make_daemon(dram_size="8MiB", ssd_size="0")
    rows = np.ones((8, BB), np.uint8)
    with Client(d.url, namespace=NS, timeout_s=5) as c:
        assert c.transport == "shm"
        threading.Timer(after_s, lambda: d.proc.send_signal(signal.SIGKILL)).start()
        deadline = time.monotonic() + 30
        with pytest.raises(Exception) as caught:
            for i in range(10**7):
                c.put_n(hash_blocks(NS, np.arange(8 * NS.block_tokens),
                                    extra=i.to_bytes(8, "little")), rows)
                assert time.monotonic() < deadline, "puts went on with the daemon dead"
        assert isinstance(caught.value, KVStoreError), repr(caught.value)


def test_close_waits_for_a_put_by_address_and_maps_nothing_after(make_daemon, monkeypatch):
    """close() from another thread while a one-tensor put by address is under way (after
    its slot lookup, before its copy): close waits for the put, which copies into the
    still-mapped arena and is read back byte-exact by another client; the next put raises
    ConnectError with nothing copied."""
    import threading

    import torch

    from kvstore.client.errors import ConnectError
    daemon = make_daemon("--dram-size", "4MiB")
    hs = chain(21, 3)
    with Client(daemon.url, namespace=NS) as c, \
            Client(daemon.url, namespace=NS, use_shm=False) as tcp:
        c.put_n(hs[:1], blocks(hs[:1]))  # opens the put channel
        find = type(c._arena.directory).find
        copied = []
        at = putpath.copy_at
        monkeypatch.setattr(putpath, "copy_at", lambda *a, **k: copied.append(1) or at(*a, **k))
        closer = threading.Thread(target=c.close)

        def find_then_close(d, h):
            found = find(d, h)
            if not closer.is_alive() and not c._closed:
                closer.start()
                time.sleep(0.3)  # (close is waiting for this put's channel by now)
                assert c._arena is not None, "close unmapped the arena under a put"
            return found
        monkeypatch.setattr(type(c._arena.directory), "find", find_then_close)
        assert c.put_n(hs[1:2], torch.from_numpy(blocks(hs[1:2]))) == [PutStatus.STORED]
        closer.join(10)
        assert not closer.is_alive() and c._closed and copied == [1]
        with pytest.raises(ConnectError):
            c.put_n(hs[2:], torch.from_numpy(blocks(hs[2:])))
        assert copied == [1]
        out = np.zeros((1, BB), np.uint8)
        assert tcp.get_n(hs[1:2], out) == [TierKind.DRAM]
        assert np.array_equal(out, blocks(hs[1:2]))


def _eventually(cond, what: str, within_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within_s, what
        time.sleep(0.005)


def test_a_put_rings_the_doorbell_only_while_the_ring_sleeps(make_daemon, monkeypatch):
    """The drainer marks a ring asleep once a pass finds nothing more: the next put rings.
    While a pass is under way (marked awake) a put publishes without ringing, and the pass
    (or the periodic one) commits it all the same."""
    daemon = make_daemon("--dram-size", "4MiB")
    hs = chain(31, 4)
    rings = []
    real = os.eventfd_write
    with Client(daemon.url, namespace=NS) as c, \
            Client(daemon.url, namespace=NS, use_shm=False) as tcp:
        c.put_n(hs[:1], blocks(hs[:1]))  # opens the put channel
        ring = c._puts.ring
        _eventually(lambda: not ring.pending() and ring.asleep(), "the pass never ended")
        monkeypatch.setattr(os, "eventfd_write", lambda fd, v: rings.append(fd) or real(fd, v))
        assert c.put_n(hs[1:2], blocks(hs[1:2])) == [PutStatus.STORED]
        assert rings == [c._puts.doorbell]
        _eventually(lambda: tcp.contains_n(hs[1:2]) == [True], "a rung put was not committed")
        _eventually(lambda: ring.asleep(), "the pass never ended")
        ring.head[putring.ASLEEP] = 0  # as a pass under way leaves it
        assert c.put_n(hs[2:3], blocks(hs[2:3])) == [PutStatus.STORED]
        assert len(rings) == 1, "a put rang while the drainer's pass was under way"
        _eventually(lambda: tcp.contains_n(hs[2:3]) == [True],
                    "a put published during a pass was never committed (the periodic pass "
                    "missed it too)")
        _eventually(lambda: ring.asleep(), "the periodic pass left the ring awake")


def test_puts_back_to_back_from_two_writers_are_committed_without_a_flush(make_daemon):
    """Two writers putting as fast as they can, each ringing only while its ring sleeps:
    every block committed with no FLUSH (a lost wake-up would strand a writer's last
    records; the periodic pass bounds that too, at DRAIN_S)."""
    import threading
    daemon = make_daemon("--dram-size", "16MiB")
    sets = [chain(40 + k, 300) for k in range(2)]
    errors = []

    def writer(hs):
        try:
            with Client(daemon.url, namespace=NS) as c:
                for i in range(len(hs)):
                    c.put_n(hs[i:i + 1], blocks(hs[i:i + 1]))
                with Client(daemon.url, namespace=NS, use_shm=False) as tcp:
                    _eventually(lambda: all(tcp.contains_n(hs)), "puts left uncommitted")
                assert c._puts is None or not c._puts.ring.pending()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=writer, args=(hs,)) for hs in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with Client(daemon.url, namespace=NS, use_shm=False) as tcp:
        out = np.zeros((300, BB), np.uint8)
        for hs in sets:
            assert None not in tcp.get_n(hs, out) and np.array_equal(out, blocks(hs))


def test_a_ring_written_without_pause_does_not_starve_other_channels(daemon):
    """A local client that moves its ring's write index on and on (garbage records, its
    doorbell rung each time): the drainer's pass over it drains once and comes back after
    the other channels (REVISIT_S later, or sooner at its doorbell), so another client's
    puts are committed (seen with no FLUSH)."""
    import threading
    stop = threading.Event()
    with raw_channel(daemon) as (_, ring, bell):
        def hostile():
            while not stop.is_set():
                ring.head[putring.CW] = ring.head[putring.CW] + ring.capacity
                os.eventfd_write(bell, 1)
        t = threading.Thread(target=hostile)
        t.start()
        try:
            hs = chain(50, 8)
            with Client(daemon.url, namespace=NS) as c, \
                    Client(daemon.url, namespace=NS, use_shm=False) as tcp:
                for i in range(len(hs)):
                    assert c.put_n(hs[i:i + 1], blocks(hs[i:i + 1])) == [PutStatus.STORED]
                _eventually(lambda: all(tcp.contains_n(hs)), "the drainer starved the writer")
        finally:
            stop.set()
            t.join(10)
