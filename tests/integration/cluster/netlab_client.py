"""A cluster client run inside a test host's network namespace; prints one JSON line.

    python netlab_client.py ETCD_URL TOKEN nodes
    python netlab_client.py ETCD_URL TOKEN put SEED N REPLICAS
    python netlab_client.py ETCD_URL TOKEN get SEED N
    python netlab_client.py ETCD_URL TOKEN converge SEED N TIMEOUT_S
"""
import json
import sys
import time

import numpy as np

from kvstore.client.cluster import ClusterClient
from kvstore.keys import Namespace, hash_blocks

NS = Namespace("test-model", num_layers=1, num_kv_heads=1, head_dim=64)  # as the daemon tests


def block_of(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, NS.block_bytes, np.uint8)


def chain(seed: int, n: int) -> list[bytes]:
    return hash_blocks(NS, list(range(seed * 100_000, seed * 100_000 + n * NS.block_tokens)))


def main() -> None:
    url, token, op, *rest = sys.argv[1:]
    replicas = int(rest[2]) if op == "put" else 1
    with ClusterClient(url, token=token, namespace=NS, replicas=replicas, timeout_s=3.0) as c:
        if op == "nodes":
            out = {"nodes": sorted(c.nodes()), "leader": c.leader_id}
        elif op == "put":
            hashes = chain(int(rest[0]), int(rest[1]))
            statuses = c.put_n(hashes, np.stack([block_of(h) for h in hashes]))
            out = {"stored": sum(s.value != "no_space" for s in statuses)}
        elif op == "get":
            hashes = chain(int(rest[0]), int(rest[1]))
            buf = np.zeros((len(hashes), NS.block_bytes), np.uint8)
            tiers = c.get_n(hashes, buf)
            wrong = sum(t is not None and not np.array_equal(row, block_of(h))
                        for h, row, t in zip(hashes, buf, tiers))
            out = {"hits": sum(t is not None for t in tiers), "wrong": wrong,
                   "answered": len(tiers)}
        else:  # converge
            hashes, deadline = chain(int(rest[0]), int(rest[1])), time.monotonic() + float(rest[2])
            t0 = time.monotonic()
            while not all(c.contains_n(hashes)) and time.monotonic() < deadline:
                time.sleep(0.1)
            out = {"converged": all(c.contains_n(hashes)), "seconds": time.monotonic() - t0}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
