"""Transfer layer throughput between two processes, per backend, against baselines measured in
the same run: a plain memcpy of the same bytes (for shm) and a raw loopback socket stream
(`sendall` / `recv_into`, same bytes, same chunk size, two processes) for tcp.

    python bench/transfer.py [--quick] [--json PATH] [--seed N]

The target process is this script with `--target` (driven over stdin/stdout; no pickle).
Single-descriptor cases keep `--depth` transfers in flight; batched cases post `--batch`
descriptors per transfer.
"""
from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import Row, add_common_args, report  # noqa: E402

from transfer import Agent, AgentConfig, BackendKind, DescList, Op, ShmSegment  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
RAW_HEAD = struct.Struct("<QQ")  # total bytes, chunk bytes


# target process -----------------------------------------------------------------------------

def _raw_serve(conn: socket.socket, buf: np.ndarray) -> None:
    """Receive streams into `buf` (rotating), ack each with one byte."""
    view = memoryview(buf)
    while True:
        head = conn.recv(RAW_HEAD.size, socket.MSG_WAITALL)
        if len(head) < RAW_HEAD.size:
            return
        total, chunk = RAW_HEAD.unpack(head)
        pos = 0
        while total:
            n = min(chunk, total)
            if pos + n > len(view):
                pos = 0
            got = 0
            while got < n:
                got += conn.recv_into(view[pos + got:pos + n])
            pos += n
            total -= n
        conn.sendall(b"k")


def _raw_server(sock: socket.socket, buf: np.ndarray) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        threading.Thread(target=_raw_serve, args=(conn, buf), daemon=True).start()


def run_target(region_bytes: int) -> None:
    agent = Agent("bench-target", AgentConfig(io_timeout_s=30.0))
    seg = ShmSegment.create(region_bytes)
    agent.register(seg)
    raw = socket.create_server(("127.0.0.1", 0))
    raw_buf = np.zeros(region_bytes, np.uint8)
    threading.Thread(target=_raw_server, args=(raw, raw_buf), daemon=True).start()
    print(agent.metadata().hex(), raw.getsockname()[1], flush=True)
    sys.stdin.readline()  # any line (or EOF) ends the target
    raw.close()
    agent.close()
    seg.close()


# initiator ----------------------------------------------------------------------------------

def timed(fn, min_time: float, min_iters: int = 3) -> float:
    """Seconds per call of `fn`, after one warm-up call."""
    fn()
    iters, start = 0, time.perf_counter()
    while True:
        fn()
        iters += 1
        elapsed = time.perf_counter() - start
        if iters >= min_iters and elapsed >= min_time:
            return elapsed / iters


class Bench:
    def __init__(self, args):
        self.args = args
        self.region_bytes = args.region_mib * MIB
        self.target = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--target",
             "--region-mib", str(args.region_mib)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        meta_hex, raw_port = self.target.stdout.readline().split()
        self.raw_port = int(raw_port)
        self.agent = Agent("bench", AgentConfig(io_timeout_s=30.0, tcp_num_conns=args.conns))
        rng = np.random.default_rng(args.seed)
        self.buf = rng.integers(0, 256, self.region_bytes, dtype=np.uint8)
        self.dst = np.zeros_like(self.buf)  # memcpy baseline target, pre-faulted
        self.region = self.agent.register(self.buf)
        self.peer = self.agent.add_peer(bytes.fromhex(meta_hex))
        self.remote_id = self.agent.peer_regions(self.peer)[0].region_id

    def close(self) -> None:
        self.agent.close()
        try:
            self.target.communicate("quit\n", timeout=10)
        except subprocess.TimeoutExpired:
            self.target.kill()
            self.target.wait()

    def lists(self, size: int, kind: BackendKind):
        count = self.region_bytes // size
        local = self.agent.prepare(DescList.uniform(self.region, size, count))
        remote = self.agent.prepare(DescList.uniform(self.remote_id, size, count),
                                    peer=self.peer, backend=kind)
        return local, remote, count

    def transfer_rate(self, kind: BackendKind, op: Op, size: int, batch: int) -> float:
        local, remote, count = self.lists(size, kind)
        per_round = max(1, count // batch)
        depth = self.args.depth if batch == 1 else 2
        idx = [np.arange(i * batch, (i + 1) * batch) % count for i in range(per_round)]

        def run():
            inflight = []
            for ix in idx:
                inflight.append(self.agent.post(op, local, ix, remote, ix))
                if len(inflight) >= depth:
                    inflight.pop(0).wait(60)
            for x in inflight:
                x.wait(60)
        return per_round * batch * size / timed(run, self.args.min_time) / 1e9

    def memcpy_rate(self, size: int, batch: int) -> float:
        count = self.region_bytes // size
        rounds = max(1, count // batch)
        src = self.buf[:rounds * batch * size].reshape(rounds, batch * size)
        dst = self.dst[:rounds * batch * size].reshape(rounds, batch * size)

        def run():
            for i in range(rounds):
                np.copyto(dst[i], src[i])
        return rounds * batch * size / timed(run, self.args.min_time) / 1e9

    def raw_socket_rate(self, size: int) -> float:
        """One stream of region_bytes in `size` chunks: sendall → recv_into, acked at the end."""
        total = (self.region_bytes // size) * size
        with socket.create_connection(("127.0.0.1", self.raw_port)) as s:
            view = memoryview(self.buf)

            def run():
                s.sendall(RAW_HEAD.pack(total, size))
                for off in range(0, total, size):
                    s.sendall(view[off:off + size])
                s.recv(1)
            return total / timed(run, self.args.min_time) / 1e9


def nixl_note() -> str | None:
    import importlib.util
    if importlib.util.find_spec("nixl") is None:
        return "NIXL not installed: no NIXL baseline row (pip install nixl-cu12 --no-deps)"
    return "NIXL installed, but its agent listens on every interface: not run here"


def run_cases(bench: Bench, sizes: list[int], batches: list[int]) -> list[Row]:
    rows: list[Row] = []
    for size in sizes:
        label = f"{size // MIB}MiB" if size >= MIB else f"{size // KIB}KiB"
        raw = bench.raw_socket_rate(size)
        rows.append(Row(f"raw socket stream {label} chunks", "GB/s", raw))
        for batch in batches:
            mem = bench.memcpy_rate(size, batch)
            rows.append(Row(f"memcpy {label} x{batch}", "GB/s", mem))
            for kind, base, base_value in ((BackendKind.SHM, "memcpy", mem),
                                           (BackendKind.TCP, "raw socket", raw)):
                for op in (Op.WRITE, Op.READ):
                    rate = bench.transfer_rate(kind, op, size, batch)
                    rows.append(Row(f"{kind.value} {op.name} {label} x{batch}", "GB/s", rate,
                                    base, base_value))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--quick", action="store_true", help="small sizes, few iterations (<30 s)")
    p.add_argument("--depth", type=int, default=8, help="single-descriptor transfers in flight")
    p.add_argument("--batch", type=int, default=64, help="descriptors per batched post")
    p.add_argument("--conns", type=int, default=1, help="tcp connections per peer")
    p.add_argument("--region-mib", type=int, default=None, help="registered bytes per side")
    p.add_argument("--min-time", type=float, default=None, help="seconds per measurement")
    p.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.target:
        return run_target(args.region_mib * MIB)
    sizes = [64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB]
    if args.quick:
        sizes, args.region_mib = [64 * KIB, 1 * MIB], args.region_mib or 16
        args.min_time = args.min_time or 0.05
    args.region_mib = args.region_mib or 256
    args.min_time = args.min_time or 0.5
    batches = [1, min(args.batch, args.region_mib * MIB // max(sizes))]
    bench = Bench(args)
    try:
        rows = run_cases(bench, sizes, batches)
    finally:
        bench.close()
    report("transfer", rows, args.json)
    note = nixl_note()
    if note:
        print(note)


if __name__ == "__main__":
    main()
