"""`kvtier serve` through the SDK, against baselines measured in the same run.

A real daemon runs in another process (DRAM tier only, so fresh puts evict instead of
writing SSD). For 256 KiB, 1 MiB and 4 MiB blocks, single and batched (16): put and get
GB/s over the same-host shared-memory path, over TCP (bytes inline in the frames) and
over the transfer layer (`use_agent=True`: a tcp transfer Agent reads/writes the daemon's
arena one-sided; what RDMA backends would carry off-host; with no put or get left inline,
as small puts and tcp gets are by default). Baselines: a memcpy of the same
bytes (shm path; puts also against the same memcpy into shared memory, gets against one
out of it, the kind of pages an arena has, with the host's huge-page policy for it named in
the row; puts also against the copy kvtier makes into slots, "kvtier's memcpy", whose
stores bypass the caches from 256 KiB: transfer.copy, where libc's memcpy keeps to the
caches below a threshold it sets by the L3 size), a raw loopback socket stream of the same
bytes with one round trip per op (TCP path), a real redis-server (SET/GET of the same
bytes, pipelined, RESP spoken directly over a socket) when `redis-server` is on PATH, and
Mooncake Store (its TCP protocol, master + storage process + client inside a
loopback-only `unshare -n` namespace; see bench/mooncake_peer.py) when `make
bench-deps-mooncake` has installed it; otherwise each prints why it was skipped. Each
path's put and get is timed in turns with its memcpy or raw-socket baselines (`paired`),
so a slow spell of a shared host weighs on both alike.
Single-op rows also give p50 / p99 latency (us) against the baseline's, and same-host ones
their p99 against a loop of memcpys as long as the op (the floor a busy host's scheduler
sets for any thread running that long). Metadata:
match_prefix over a 1,000-block chain and contains_n of 1,000 keys vs the same calls on an
in-process TieredStore. The asyncio client against the blocking one (single ops, and 16
gets in flight vs 16 threads), on asyncio's loop and on uvloop's. `--busy N` runs
everything, baselines included, while N processes burn the CPUs (the host an inference
engine shares).

    python bench/store_service.py [--quick] [--busy N] [--rounds N] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
import uvloop

from kvstore.client import AsyncClient, Client
from kvstore.daemon.process import DaemonProcess
from kvstore.config import StoreConfig, TierConfig
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks
from kvstore.store import TieredStore
from kvstore.tuning import freeze_gc_heap

from kvtier.report import Row, add_common_args, median_rows, report
from transfer.copy import STREAMING, copy_arrays
from transfer.shm import ShmSegment
from bench.mooncake_peer import mooncake_rates

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"256KiB": 256 * KiB, "1MiB": MiB, "4MiB": 4 * MiB}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shmem_thp() -> str:
    """The host's transparent-huge-page policy for shared memory (the arena's pages)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            mode = next(w[1:-1] for w in f.read().split() if w.startswith("["))
    except (OSError, StopIteration):
        return "THP unknown"
    return f"THP {mode}"


SHMEM_THP = _shmem_thp()


def namespace_for(block_bytes: int) -> Namespace:
    return Namespace("bench", num_layers=block_bytes // (32 * KiB), num_kv_heads=8, head_dim=64)


class Stats(NamedTuple):
    gbps: float
    p50_us: float
    p99_us: float


def measure(fn, nbytes: int, seconds: float) -> Stats:
    """GB/s of repeated fn() calls moving nbytes each over about `seconds`, and the p50 /
    p99 latency of one call."""
    return paired([fn], nbytes, seconds)[0]


def paired(fns, nbytes: int, seconds: float, turns: int = 4) -> list[Stats]:
    """`measure` of a row and its baselines together: each timed for seconds/turns in
    turn, `turns` times over (the order rotating), so a shared host's slow spell weighs on
    a row and its baselines alike. Timed one after another instead, a row and its
    baseline moved +-20% against each other between runs on this 2-core VM."""
    for fn in fns:
        fn()  # warm-up: first touch of buffers, a put channel's grants
    times: list[list[float]] = [[] for _ in fns]
    for turn in range(turns):
        for k in range(len(fns)):
            i = (k + turn) % len(fns)  # no function always runs right after the same other
            fn, ts, t0 = fns[i], times[i], time.perf_counter()
            while True:
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
                if t - t0 >= seconds / turns and len(ts) >= 5 * (turn + 1):
                    break
    return [_stats(ts, nbytes) for ts in times]


def _stats(times: list[float], nbytes: int) -> Stats:
    p50, p99 = np.percentile(times, [50, 99]) * 1e6
    return Stats(len(times) * nbytes / sum(times) / 1e9, float(p50), float(p99))


def rate(fn, nbytes: int, seconds: float) -> float:
    return measure(fn, nbytes, seconds).gbps


def ops_rate(fn, seconds: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds or n < 3:
        fn()
        n += 1
    return n / dt


# ------------------------------------------------------------------ raw socket baseline


# Both ends of the raw socket receive at most this much a call: a 4 MiB get received in one
# recv_into a call (what arrived so far, each time) moved 3.3 GB/s here, in 64 KiB calls
# 4.3-4.8 (the daemon and the client receive so too: kvstore.wire.RECV_CHUNK).
RAW_CHUNK = 64 << 10


def _sink(ports) -> None:
    gc.freeze()  # as the bench process does (see main): no collection pauses the baseline
    srv = socket.create_server(("127.0.0.1", 0))  # the kernel picks the port
    ports.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(128 * MiB)
    view = memoryview(buf)
    at = 0  # where the next put lands (see RawSocket)
    while True:
        head = conn.recv(9, socket.MSG_WAITALL)
        if len(head) < 9:
            return
        op, n = struct.unpack("<cQ", head)
        if op == b"P":
            at = at + n if at + 2 * n <= len(buf) else 0
            got = 0
            while got < n:
                lo = (at + got) % len(buf)  # (an op bigger than the buffer wraps round)
                got += conn.recv_into(view[lo:min(len(buf), lo + n - got, lo + RAW_CHUNK)])
            conn.sendall(b"k")
        else:
            conn.sendall(view[:n])


class RawSocket:
    """One request/ack (put) or request/stream (get) per op, like the daemon's protocol.
    A put lands in a new part of the sink's 128 MiB each time, as a store's puts land in
    slots it has not just written (cf. RotatingCopy). It used to land every partial
    receive at the buffer's start, a few hundred KiB kept hot in cache, and no store's
    case: measured here, that sink took a 4 MiB put in ~0.9-1.0 ms against ~1.4-1.7 ms
    for one landing in memory not just written (1 MiB: ~270 vs ~280-340 us). A get streams
    one buffer, as the store's gets here re-read one stored set. Both ends receive in
    RAW_CHUNK calls."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        ports = ctx.Queue()
        self.proc = ctx.Process(target=_sink, args=(ports,), daemon=True)
        self.proc.start()
        port = ports.get(timeout=60)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, data: memoryview) -> None:
        self.sock.sendall(struct.pack("<cQ", b"P", len(data)))
        self.sock.sendall(data)
        self.sock.recv(1)

    def get(self, out: memoryview) -> None:
        self.sock.sendall(struct.pack("<cQ", b"G", len(out)))
        got, n = 0, len(out)
        while got < n:
            got += self.sock.recv_into(out[got:], min(RAW_CHUNK, n - got))

    def close(self) -> None:
        self.sock.close()
        self.proc.join(5)


# ------------------------------------------------------------------ redis (RESP by hand)


class RedisPeer:
    """A redis-server on a free loopback port, driven with pipelined SET/GET."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc = proc
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile = self.sock.makefile("rb", buffering=1 << 20)

    @staticmethod
    def skip_reason() -> str:
        return "redis-server is not on PATH (apt-get install redis-server)"

    @classmethod
    def start(cls) -> "RedisPeer | None":
        """redis takes no port 0: a free one is picked, and a start that lost the race for
        it (redis exits) is tried again on another."""
        exe = shutil.which("redis-server")
        if exe is None:
            return None
        for _ in range(5):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                     "", "--appendonly", "no", "--protected-mode", "yes"],
                                    stdout=subprocess.DEVNULL)
            while proc.poll() is None:
                try:
                    peer = cls(proc, port)
                except OSError:
                    time.sleep(0.05)
                    continue
                peer.sock.sendall(b"PING\r\n")
                if peer.rfile.readline() == b"+PONG\r\n":
                    return peer
                peer.stop()  # something else answered on that port
                break
        return None

    def set_n(self, keys: list[bytes], value: memoryview) -> None:
        head = b"$%d\r\n" % len(value)
        bufs = []
        for k in keys:
            bufs += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n" % (len(k), k) + head, value, b"\r\n"]
        self.sock.sendmsg(bufs) if sum(map(len, bufs)) < (1 << 16) else _send_all(self.sock, bufs)
        for _ in keys:
            assert self.rfile.readline() == b"+OK\r\n"

    def get_n(self, keys: list[bytes], out: memoryview) -> None:
        self.sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)
                                   for k in keys))
        n = len(out) // len(keys)
        for i in range(len(keys)):
            line = self.rfile.readline()
            self.rfile.readinto(out[i * n:(i + 1) * n])
            self.rfile.read(2)
            assert int(line[1:]) == n

    def rates(self, nbytes: int, batch: int, seconds: float) -> tuple[float, float]:
        value = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, np.uint8))
        out = memoryview(bytearray(nbytes * batch))
        keys = [b"k%d-%d" % (nbytes, i) for i in range(batch)]
        return (rate(lambda: self.set_n(keys, value), nbytes * batch, seconds),
                rate(lambda: self.get_n(keys, out), nbytes * batch, seconds))

    def stop(self) -> None:
        self.sock.close()
        self.proc.terminate()
        self.proc.wait(10)


def _send_all(sock: socket.socket, bufs: list) -> None:
    for b in bufs:
        sock.sendall(b)


# ------------------------------------------------------------------ the daemon


def start_daemon(workdir: str) -> DaemonProcess:
    return DaemonProcess(workdir, cwd=ROOT, dram_size="192MiB", ssd_size="0").start()


STREAMED = "kvtier's memcpy"  # the same-host puts' last baseline (_batch_rows)


class RotatingCopy:
    """The memcpy a put is held to: the same bytes into a new destination each time, over
    64 MiB of them, as a store writes slots it has not just written (a copy into one hot
    destination runs from cache and is no store's case)."""

    def __init__(self, src: np.ndarray, shared: bool = False, copy=np.copyto) -> None:
        self.src, self.copy = src, copy
        n = max(2, (64 * MiB) // src.nbytes)
        self.segment = ShmSegment.anonymous(n * src.nbytes, "bench-memcpy") if shared else None
        self.dsts = (self.segment.array.reshape(n, src.nbytes) if shared
                     else np.empty((n, src.nbytes), np.uint8))
        self.dsts[:] = 1  # faulted in, as an arena is
        self.i = 0

    def __call__(self) -> None:
        self.i = (self.i + 1) % len(self.dsts)
        self.copy(self.dsts[self.i], self.src)


BUSY_LOOP = ("import torch; torch.set_num_threads(1); a = torch.randn(384, 384); a @ a\n"
             "print('burning', flush=True)\n"
             "while True: a @ a")


def start_busy(n: int) -> list[subprocess.Popen]:
    """n processes burning a CPU each (matmul on one torch thread), for --busy; returns
    once every one of them is in its loop (importing torch takes a second or two, and a
    baseline measured before that would have had a quiet host)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdout=subprocess.PIPE,
                              text=True) for _ in range(n)]
    for p in procs:
        if p.stdout.readline().strip() != "burning":
            stop_busy(procs)
            raise RuntimeError(f"a --busy process exited ({p.wait()}) before it started")
    if n:
        print(f"busy: {n} processes running a torch matmul loop (1 thread each)")
    return procs


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


FRESH_PUTS = 1024  # puts' worth of fresh hashes made at once (Case._fresh)


class Case:
    """Fresh hashes for every put (so each put moves bytes); gets re-read one stored set."""

    def __init__(self, client: Client, ns: Namespace, batch: int) -> None:
        self.c, self.ns, self.batch = client, ns, batch
        self.src = torch.randint(0, 256, (batch, ns.block_bytes), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.round = 0
        self._pool: list[list[bytes]] = []
        self.stored = self._fresh()
        client.put_n(self.stored, self.src)
        client.pin_n(self.stored)  # the puts that follow must not evict the set gets re-read

    def close(self) -> None:
        self.c.unpin_n(self.stored)

    def _fresh(self) -> list[bytes]:
        """`batch` hashes never put before, made FRESH_PUTS puts' worth at a time: a put is
        timed without the hashing of its keys (an engine has them already; ~5 us of a
        ~35 us same-host 256 KiB put was hash_blocks, timed as the store's until now)."""
        if not self._pool:
            self.round += 1
            toks = np.arange(FRESH_PUTS * self.batch * self.ns.block_tokens)
            hs = hash_blocks(self.ns, toks, extra=struct.pack("<QQ", self.round, id(self)))
            self._pool = [hs[i:i + self.batch] for i in range(0, len(hs), self.batch)][::-1]
        return self._pool.pop()

    def put(self) -> None:
        self.c.put_n(self._fresh(), self.src)

    def get(self) -> None:
        if None in self.c.get_n(self.stored, self.dst):
            raise RuntimeError("a benchmark get missed: the figures would be meaningless")


def data_rows(url: str, redis: RedisPeer | None, mooncake: dict | None, raw: RawSocket,
              seconds: float) -> list[Row]:
    rows = []
    for label, nbytes in SIZES.items():
        ns = namespace_for(nbytes)
        clients = {"shm": Client(url, namespace=ns),
                   "tcp": Client(url, namespace=ns, use_shm=False),
                   # the transfer-agent path itself (no put or get falls back to inline
                   # bytes, as small ones do by default)
                   "agent": Client(url, namespace=ns, use_shm=False, use_agent=True,
                                   inline_put_bytes=0, inline_get_bytes=0)}
        assert clients["shm"].uses_shm, "the bench runs on the daemon's host"
        assert clients["agent"].transport == "agent", "the daemon exports its arena (tcp)"
        for batch in (1, 16):
            rows += _batch_rows(clients, ns, label, nbytes, batch, redis, mooncake, raw, seconds)
        for c in clients.values():
            c.close()
    return rows


def _batch_rows(clients, ns, label, nbytes, batch, redis, mooncake, raw, seconds) -> list[Row]:
    """Each path's put and get, timed in turn with their baselines (`paired`)."""
    total = nbytes * batch
    a = torch.randint(0, 256, (total,), dtype=torch.uint8)
    b = torch.empty_like(a)
    view = memoryview(b.numpy())
    # the same copy into shared memory (what an arena is): private memory may get huge
    # pages where shared memory does not (see SHMEM_THP), and a copy runs slower on 4 KiB
    into_shm = RotatingCopy(a.numpy(), shared=True)
    # and a get's: out of shared memory (the leased arena slots) into private memory
    out_of = ShmSegment.anonymous(total, "bench-memcpy")
    out_of.array[:] = a.numpy()
    bases = {  # (name, fn) per op: the first one is the row's p50 / p99 baseline
        "shm": {"put": [("memcpy", RotatingCopy(a.numpy())),
                        (f"memcpy into shm ({SHMEM_THP})", into_shm)],
                "get": [("memcpy", lambda: np.copyto(b.numpy(), a.numpy())),
                        (f"memcpy from shm ({SHMEM_THP})",
                         lambda: np.copyto(b.numpy(), out_of.array[:total]))]},
        "socket": {"put": [("raw socket", lambda: raw.put(memoryview(a.numpy())))],
                   "get": [("raw socket", lambda: raw.get(view))]}}
    if STREAMING:  # the copy a put makes into slots (transfer.copy: around the caches
        # from 256 KiB), where libc's memcpy keeps to the caches
        put_copy = partial(copy_arrays, cold=True)
        bases["shm"]["put"].append((STREAMED, RotatingCopy(a.numpy(), copy=put_copy)))
    copies = {  # the row's first baseline, of n bytes (`_twin_row`)
        "put": lambda n: RotatingCopy(np.resize(a.numpy(), n)),
        "get": lambda n: partial(np.copyto, np.empty(n, np.uint8), np.resize(a.numpy(), n))}
    peer = redis.rates(nbytes, batch, seconds) if redis else None
    rows = []
    try:
        for path, client in clients.items():
            case = Case(client, ns, batch)
            name = f"{path} {{}} {label} x{batch}"
            named = bases["shm" if path == "shm" else "socket"]
            got = {op: paired([getattr(case, op)] + [fn for _, fn in named[op]], total, seconds)
                   for op in ("get", "put")}
            case.close()
            for op in ("put", "get"):
                rows += [Row(name.format(op), "GB/s", got[op][0].gbps, base, st.gbps)
                         for (base, _), st in zip(named[op], got[op][1:])]
            if batch == 1:  # one op's latency: the figure a busy host hurts first
                for op in ("put", "get"):
                    (st, bst), base = got[op][:2], named[op][0][0]
                    rows += [Row(name.format(op) + " p50", "us", st.p50_us, base, bst.p50_us),
                             Row(name.format(op) + " p99", "us", st.p99_us, base, bst.p99_us)]
                    if path == "shm":
                        rows.append(_twin_row(name.format(op), st, bst, copies[op],
                                              total, seconds))
            if peer and path == "tcp":
                rows += [Row(name.format("put"), "GB/s", got["put"][0].gbps, "redis", peer[0]),
                         Row(name.format("get"), "GB/s", got["get"][0].gbps, "redis", peer[1])]
            if mooncake and path == "tcp" and (label, batch) in mooncake:
                mc_put, mc_get = mooncake[label, batch]
                rows += [Row(name.format("put"), "GB/s", got["put"][0].gbps, "mooncake", mc_put),
                         Row(name.format("get"), "GB/s", got["get"][0].gbps, "mooncake", mc_get)]
    finally:
        into_shm.segment.close()
        out_of.close()
    return rows


TWIN = "a memcpy as long as its p50"  # (one label: `median_rows` pairs rounds by it)


def _twin_row(name: str, op: Stats, copy: Stats, make_copy, nbytes: int, seconds: float) -> Row:
    """The p99 floor a host's scheduler sets for an op as long as this one: one memcpy of
    as many bytes as take the op's p50 (`make_copy(n)`: the row's first baseline, of n
    bytes; the same CPU time, no store in it), measured now. A thread that runs that long
    is preempted about as often whatever it does, so a p99 at the twin's is the host's, not
    the store's. Under --busy 2 on a 2-core VM, a thread putting back to back was preempted
    about every 3 ms: an op of ~24 us (one 256 KiB memcpy) straddled fewer than 1% of them
    and kept a p99 of ~65 us, one of ~33 us more than 1%, its p99 then the wait (~0.8-4 ms).
    (This twin used to be a whole number of memcpys, rounded: one memcpy for a 33 us put.)"""
    ratio = op.p50_us / copy.p50_us
    twin = paired([make_copy(max(1, round(nbytes * ratio)))], nbytes, seconds)[0]
    return Row(name + " p99", "us", op.p99_us, TWIN, twin.p99_us)


async def apaired(fns, nbytes: int, seconds: float, turns: int = 4) -> list[Stats]:
    """`paired` inside one running event loop, for plain functions (the blocking client,
    run on the loop's thread: nothing else is on the loop meanwhile) and coroutine
    functions (the AsyncClient) alike: each timed for seconds/turns in turn, `turns` times
    over, the order rotating. Timed one after the other, a blocking row and its async one
    fell into different spells of this VM (uvloop's 1 MiB get 0.27x the blocking client in
    one run, 0.91x in the next)."""
    async def call(fn):
        if asyncio.iscoroutinefunction(fn):
            await fn()
        else:
            fn()
    for fn in fns:
        await call(fn)  # warm-up: first touch of buffers, a put channel's grants
    times: list[list[float]] = [[] for _ in fns]
    for turn in range(turns):
        for k in range(len(fns)):
            i = (k + turn) % len(fns)
            fn, ts, t0 = fns[i], times[i], time.perf_counter()
            while True:
                t = time.perf_counter()
                await call(fn)
                ts.append(time.perf_counter() - t)
                if t - t0 >= seconds / turns and len(ts) >= 5 * (turn + 1):
                    break
    return [_stats(ts, nbytes) for ts in times]


def async_rows(url: str, seconds: float) -> list[Row]:
    """AsyncClient (frames on the event loop) against the blocking Client on the same
    path, timed in turns with it (`apaired`): single ops, and 16 gets in flight at once
    (asyncio.gather vs 16 threads), on asyncio's own event loop and on uvloop's (what
    vLLM's and SGLang's servers run)."""
    rows = []
    par = 16
    for label in ("256KiB", "1MiB"):
        ns, nbytes = namespace_for(SIZES[label]), SIZES[label]
        for path, opts in (("shm", {}), ("tcp", {"use_shm": False})):
            sync = Client(url, namespace=ns, **opts)
            case = Case(sync, ns, 1)
            dsts = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(par)]
            with ThreadPoolExecutor(par) as pool:
                def threaded():
                    list(pool.map(lambda d: sync.get_n(case.stored, [d]), dsts))

                async def run():
                    async with AsyncClient(url, namespace=ns, **opts) as c:
                        dst, many = torch.empty_like(case.dst), dsts

                        async def aget():
                            await c.get_n(case.stored, dst)

                        async def aput():
                            await c.put_n(case._fresh(), case.src)

                        async def agather():
                            await asyncio.gather(*(c.get_n(case.stored, [d]) for d in many))
                        get, ag = await apaired([case.get, aget], nbytes, seconds)
                        put, ap = await apaired([case.put, aput], nbytes, seconds)
                        thr, agg = await apaired([threaded, agather], nbytes * par, seconds)
                        return get, ag, put, ap, thr, agg

                for loop_name, run_loop in (("async", asyncio.run),
                                            ("async(uvloop)", uvloop.run)):
                    get, aget, put, aput, threads, agather = run_loop(run())
                    name = f"{loop_name} {path} {{}} {label} x1"
                    rows += [Row(name.format("put"), "GB/s", aput.gbps, "blocking Client",
                                 put.gbps),
                             Row(name.format("get"), "GB/s", aget.gbps, "blocking Client",
                                 get.gbps),
                             Row(name.format("get") + " p50", "us", aget.p50_us,
                                 "blocking Client", get.p50_us),
                             Row(f"{loop_name} {path} get {label}, {par} in flight", "GB/s",
                                 agather.gbps, f"blocking Client, {par} threads",
                                 threads.gbps)]
            case.close()
            sync.close()
    return rows


def metadata_rows(url: str, seconds: float) -> list[Row]:
    ns = Namespace("bench-meta", num_layers=1, num_kv_heads=1, head_dim=64)
    hs = hash_blocks(ns, np.arange(1000 * ns.block_tokens))
    blocks = torch.zeros(1000, ns.block_bytes, dtype=torch.uint8)
    local = TieredStore(ns, StoreConfig((TierConfig(TierKind.DRAM, 2000),)))
    rows = []
    with Client(url, namespace=ns) as c:
        c.put_n(hs, blocks)
        local.put_n(hs, blocks)
        for name, remote, inproc in (
                ("match_prefix 1000-block chain", lambda: c.match_prefix(hs),
                 lambda: local.match_prefix(hs)),
                ("contains_n 1000 keys", lambda: c.contains_n(hs), lambda: local.contains_n(hs))):
            rows.append(Row(name, "ops/s", ops_rate(remote, seconds), "in-process store",
                            ops_rate(inproc, seconds)))
    local.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--quick", action="store_true", help="short run (< 30 s)")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="measure everything (kvtier and every baseline) while N other "
                   "processes keep the CPUs busy with a torch matmul loop, as the inference "
                   "engines beside a store would")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="measure the data rows (and Mooncake, in its own process between "
                   "them) N times and report each figure's median: Mooncake is not timed in "
                   "turns with kvtier, so on a busy host one round compares two different "
                   "spells of load")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be 1 or more")
    torch.manual_seed(args.seed)
    seconds = 0.08 if args.quick else 0.4
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-")
    busy = start_busy(args.busy)
    daemon = start_daemon(workdir)
    url = daemon.url
    raw = RawSocket()
    redis = RedisPeer.start()
    if redis is None:
        print(f"redis: skipped ({RedisPeer.skip_reason()})")
    # As an engine process runs once its model is loaded (vLLM freezes its heap after
    # warm-up): what the setup built is out of the cyclic GC. A full pass over a process
    # that imported torch stops it for 40-85 ms, and one of those inside a measurement
    # window (80 ms with --quick) doubled that row's mean, on whichever side happened to
    # allocate the object that triggered it.
    freeze_gc_heap()
    try:
        rounds = []
        for r in range(args.rounds):
            mooncake, why = mooncake_rates(SIZES, (1, 16), seconds)
            if r == 0:
                print(f"mooncake: {why}" if mooncake else f"mooncake: skipped ({why})")
            if args.rounds > 1:
                print(f"round {r + 1} of {args.rounds}", flush=True)
            rounds.append(data_rows(url, redis, mooncake, raw, seconds))
        rows = median_rows(rounds) + async_rows(url, seconds) + metadata_rows(url, seconds)
    finally:
        raw.close()
        if redis:
            redis.stop()
        daemon.close()
        stop_busy(busy)
        shutil.rmtree(workdir, ignore_errors=True)
    if args.rounds > 1:
        print(f"data rows: the median of {args.rounds} rounds (value and baseline each)")
    report("store_service", rows, args.json)


if __name__ == "__main__":
    main()
