"""Transfer layer throughput between two processes, per backend, against baselines measured in
the same run: a plain memcpy of the same bytes (for shm) and a raw loopback socket stream
(`sendall` / `recv_into`, same bytes, same chunk size, two processes) for tcp; and, when NIXL
is installed, NIXL's own agent (UCX, DRAM→DRAM, its prepped-list hot path) on the same bytes,
against which our nixl/ucx adapters and our shm/tcp rows are compared.

    python bench/transfer.py [--quick] [--json PATH] [--seed N] [--no-adapters]

NIXL and UCX listen on every network interface, so their part (both processes) runs in a
child of this script under `unshare -n` with loopback alone (`--adapters-only`), and its rows
are merged into this run's table.

The target process is this script with `--target` (driven over stdin/stdout; no pickle).
Single-descriptor cases keep `--depth` transfers in flight; batched cases post `--batch`
descriptors per transfer.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from kvtier.report import Row, add_common_args, report

from transfer import (Agent, AgentConfig, BackendKind, DescList, Op, ShmSegment,
                      TransferError, backends)

KIB, MIB = 1 << 10, 1 << 20
RAW_HEAD = struct.Struct("<QQ")  # total bytes, chunk bytes


# NIXL's own agent (the baseline; only inside `unshare -n`) --------------------------------

def _nixl_api():
    from transfer.backends.nixl import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


class NixlTarget:
    """A bare NIXL agent exporting `region_bytes` of DRAM; `describe()` is what peers need."""

    def __init__(self, region_bytes: int):
        nixl_agent, nixl_agent_config = _nixl_api()
        self.agent = nixl_agent("nixl-baseline-target", nixl_agent_config(backends=["UCX"]))
        self.buf = np.zeros(region_bytes, np.uint8)
        self.addr = self.buf.ctypes.data
        self.reg = self.agent.register_memory([(self.addr, region_bytes, 0, "")], "DRAM")

    def describe(self) -> str:
        return f"{self.agent.get_agent_metadata().hex()}:{self.addr}"


class NixlInitiator:
    """NIXL's intended hot path: lists prepped once per size, posts by index, polled."""

    def __init__(self, buf: np.ndarray, described: str):
        nixl_agent, nixl_agent_config = _nixl_api()
        md_hex, addr = described.split(":")
        self.agent = nixl_agent("nixl-baseline", nixl_agent_config(backends=["UCX"]))
        self.buf, self.remote_addr = buf, int(addr)
        self.reg = self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        self.remote = self.agent.add_remote_agent(bytes.fromhex(md_hex))
        self.lists: dict[int, tuple] = {}
        self.current = None

    def prepare(self, size: int, count: int) -> None:
        if size not in self.lists:
            offs = np.arange(count, dtype=np.uint64) * size
            def rows(base):
                return np.stack([base + offs, np.full(count, size, np.uint64),
                                 np.zeros(count, np.uint64)], axis=1)
            self.lists[size] = (
                self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows(self.buf.ctypes.data),
                                           "DRAM"),
                self.agent.prep_xfer_dlist(self.remote, rows(self.remote_addr), "DRAM"))
        self.current = self.lists[size]

    def _wait(self, handle) -> None:
        while (state := self.agent.check_xfer_state(handle)) == "PROC":
            pass
        if state != "DONE":
            raise RuntimeError("NIXL transfer failed")
        handle.release()

    def run(self, op: str, idx: list[np.ndarray], depth: int) -> None:
        local, remote = self.current
        inflight = []
        for ix in idx:
            ix = ix.astype(np.int32)
            handle = self.agent.make_prepped_xfer(op, local, ix, remote, ix)
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL refused the transfer")
            inflight.append(handle)
            if len(inflight) >= depth:
                self._wait(inflight.pop(0))
        for handle in inflight:
            self._wait(handle)

    def close(self) -> None:
        for local, remote in self.lists.values():
            local.release()
            remote.release()
        self.agent.remove_remote_agent(self.remote)


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


def run_target(region_bytes: int, backends: tuple[BackendKind, ...]) -> None:
    agent = Agent("bench-target", AgentConfig(backends=backends, io_timeout_s=30.0))
    seg = ShmSegment.create(region_bytes)
    agent.register(seg)
    raw = socket.create_server(("127.0.0.1", 0))
    raw_buf = np.zeros(region_bytes, np.uint8)
    threading.Thread(target=_raw_server, args=(raw, raw_buf), daemon=True).start()
    nixl_target = NixlTarget(region_bytes) if BackendKind.NIXL in backends else None
    print("READY", agent.metadata().hex(), raw.getsockname()[1],
          nixl_target.describe() if nixl_target else "-", flush=True)
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
        backends = args.backends
        self.target = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--target",
             "--region-mib", str(args.region_mib), "--backends",
             ",".join(k.value for k in backends)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        line = ""
        while not line.startswith("READY "):  # NIXL may log to stdout before it
            line = self.target.stdout.readline()
            if not line:
                raise RuntimeError("bench target exited before it was ready")
        meta_hex, raw_port, self.nixl_target = line.split()[1:]
        self.raw_port = int(raw_port)
        self.agent = Agent("bench", AgentConfig(backends=backends, io_timeout_s=30.0,
                                                tcp_num_conns=args.conns))
        rng = np.random.default_rng(args.seed)
        self.buf = rng.integers(0, 256, self.region_bytes, dtype=np.uint8)
        self.dst = np.zeros_like(self.buf)  # memcpy baseline target, pre-faulted
        self.region = self.agent.register(self.buf)
        self.nixl = (NixlInitiator(self.buf, self.nixl_target)
                     if self.nixl_target != "-" else None)
        self.peer = self.agent.add_peer(bytes.fromhex(meta_hex))
        self.remote_id = self.agent.peer_regions(self.peer)[0].region_id

    def close(self) -> None:
        if self.nixl is not None:
            self.nixl.close()
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


    def nixl_rate(self, op: Op, size: int, batch: int) -> float:
        """NIXL's own agent: descriptor lists prepped once, posts by index, same pattern."""
        count = self.region_bytes // size
        per_round = max(1, count // batch)
        depth = self.args.depth if batch == 1 else 2
        self.nixl.prepare(size, count)
        idx = [np.arange(i * batch, (i + 1) * batch) % count for i in range(per_round)]
        return per_round * batch * size / timed(lambda: self.nixl.run(op.name, idx, depth),
                                                self.args.min_time) / 1e9


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


ADAPTERS = (BackendKind.NIXL, BackendKind.UCX)


def importable(kind: BackendKind) -> bool:
    try:
        backends.load(kind)
    except TransferError:
        return False
    return True


def loopback_only() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def run_adapter_cases(bench: Bench, sizes: list[int], batches: list[int]) -> list[Row]:
    """NIXL's own agent, then our nixl/ucx adapters against it (inside `unshare -n`)."""
    rows: list[Row] = []
    kinds = [k for k in ADAPTERS if k in bench.args.backends]
    for size in sizes:
        label = f"{size // MIB}MiB" if size >= MIB else f"{size // KIB}KiB"
        for batch in batches:
            for op in (Op.WRITE, Op.READ):
                base = bench.nixl_rate(op, size, batch) if bench.nixl else None
                if base is not None:
                    rows.append(Row(f"NIXL agent {op.name} {label} x{batch}", "GB/s", base))
                for kind in kinds:
                    rate = bench.transfer_rate(kind, op, size, batch)
                    rows.append(Row(f"{kind.value} {op.name} {label} x{batch}", "GB/s", rate,
                                    "NIXL agent" if base else None, base))
    return rows


def adapter_rows_in_netns(args, sizes: list[int]) -> tuple[list[Row], str | None]:
    """Run this script with --adapters-only under `unshare -n`; its rows, or why none."""
    kinds = [k for k in ADAPTERS if importable(k)]
    if not kinds:
        return [], ("NIXL/UCX not installed: no NIXL baseline or adapter rows "
                    "(pip install --no-deps nixl-cu12 ...; see transfer/backends/nixl.py)")
    if shutil.which("unshare") is None:
        return [], "`unshare` missing: NIXL/UCX are only run inside a loopback-only namespace"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--adapters-only", "--json", out,
               "--seed", str(args.seed), "--region-mib", str(args.region_mib),
               "--min-time", str(args.min_time), "--depth", str(args.depth),
               "--batch", str(args.batch), "--sizes", ",".join(map(str, sizes))]
        script = "ip link set lo up && exec " + " ".join(f"'{c}'" for c in cmd)
        done = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True,
                              text=True)
        if done.returncode != 0 or not os.path.exists(out):
            return [], f"adapter run under unshare -n failed: {done.stderr.strip()[-2000:]}"
        with open(out) as f:
            doc = json.load(f)
    rows = [Row(r["case"], r["metric"], r["value"], r["baseline"], r["baseline_value"])
            for r in doc["results"]]
    return rows, None


def versus_nixl(rows: list[Row], adapter_rows: list[Row]) -> list[Row]:
    """Our shm/tcp rows again, now against NIXL's agent on the same op, size and batch."""
    nixl = {r.case.removeprefix("NIXL agent "): r.value for r in adapter_rows
            if r.case.startswith("NIXL agent ")}
    out = []
    for r in rows:
        kind, _, rest = r.case.partition(" ")
        if kind in ("shm", "tcp") and rest in nixl:
            out.append(Row(f"{r.case} vs NIXL", "GB/s", r.value, "NIXL agent", nixl[rest]))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--quick", action="store_true", help="small sizes, few iterations (<30 s)")
    p.add_argument("--depth", type=int, default=8, help="single-descriptor transfers in flight")
    p.add_argument("--batch", type=int, default=64, help="descriptors per batched post")
    p.add_argument("--conns", type=int, default=1, help="tcp connections per peer")
    p.add_argument("--region-mib", type=int, default=None, help="registered bytes per side")
    p.add_argument("--min-time", type=float, default=None, help="seconds per measurement")
    p.add_argument("--no-adapters", action="store_true",
                   help="skip NIXL's agent and the nixl/ucx adapters even when installed")
    p.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--adapters-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backends", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.target:
        return run_target(args.region_mib * MIB,
                          tuple(BackendKind(k) for k in args.backends.split(",")))
    sizes = [64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB]
    if args.quick:
        sizes, args.region_mib = [64 * KIB, 1 * MIB], args.region_mib or 16
        args.min_time = args.min_time or 0.05
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else sizes
    args.region_mib = args.region_mib or 256
    args.min_time = args.min_time or 0.5
    batches = [1, min(args.batch, args.region_mib * MIB // max(sizes))]
    if args.adapters_only:
        if not loopback_only():
            raise SystemExit("--adapters-only runs only inside `unshare -n` (loopback alone)")
        args.backends = (BackendKind.TCP,) + tuple(k for k in ADAPTERS if importable(k))
        bench = Bench(args)
        try:
            rows = run_adapter_cases(bench, sizes, batches)
        finally:
            bench.close()
        return report("transfer-adapters", rows, args.json)
    args.backends = (BackendKind.LOCAL, BackendKind.SHM, BackendKind.TCP)
    bench = Bench(args)
    try:
        rows = run_cases(bench, sizes, batches)
    finally:
        bench.close()
    note = "NIXL/UCX rows skipped (--no-adapters)"
    if not args.no_adapters:
        extra, note = adapter_rows_in_netns(args, sizes)
        rows += versus_nixl(rows, extra) + extra
    report("transfer", rows, args.json)
    if note:
        print(note)


if __name__ == "__main__":
    main()
