"""Put / get throughput of each store tier against a baseline measured in the same run.

GPU and DRAM tiers are compared with a plain memcpy (single-threaded, numpy) of the same
bytes; the SSD tier with a plain sequential file write / read of the same bytes in the same
directory, warm (from the page cache) and cold (both files written back and dropped from
the page cache with fdatasync + POSIX_FADV_DONTNEED before every read).
On a machine without CUDA the GPU tier runs on a CPU tensor (and says so). Also reports
block-hashing throughput against one xxh3_128 pass over the same token bytes.

    python bench/store_tiers.py [--quick] [--json PATH] [--dir DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import xxhash

from kvtier.report import Row, add_common_args, report


from kvstore.config import StoreConfig, TierConfig
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks
from kvstore.store import TieredStore
from kvstore.tiers.gpu import default_device
from kvstore.tuning import tune_malloc_for_large_blocks

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"16KiB": 16 * KiB, "256KiB": 256 * KiB, "1MiB": MiB, "4MiB": 4 * MiB}


def namespace_for(block_bytes: int) -> Namespace:
    """A float16 namespace whose blocks are exactly `block_bytes` (16 tokens, 4 or 8 heads)."""
    if block_bytes < 32 * KiB:
        return Namespace("bench", num_layers=1, num_kv_heads=4, head_dim=block_bytes // 256)
    return Namespace("bench", num_layers=block_bytes // (32 * KiB), num_kv_heads=8, head_dim=64)


def median_time(fn, reps: int) -> float:
    fn()  # warm-up: first touch of buffers, RocksDB memtables, thread pools
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class TierCase:
    """A one-tier store of 2n slots; every put writes n fresh blocks (evicting old ones)."""

    def __init__(self, kind: TierKind, ns: Namespace, n: int, batch: int, workdir: str,
                 durable: bool) -> None:
        self.ns, self.n, self.batch = ns, n, batch
        path = os.path.join(workdir, f"ssd-{ns.block_bytes}-{batch}-{durable}")
        cfg = TierConfig(kind, 2 * n, path=path if kind is TierKind.SSD else None, durable=durable)
        self.store = TieredStore(ns, StoreConfig((cfg,), promote_on_hit=False))
        self.src = torch.randint(0, 256, (n, ns.block_bytes), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.round = 0
        self.hashes: list[bytes] = []

    def put(self) -> None:
        self.round += 1
        toks = np.arange(self.n * self.ns.block_tokens) + self.round * 10**7
        self.hashes = hash_blocks(self.ns, toks)
        for i in range(0, self.n, self.batch):
            self.store.put_n(self.hashes[i:i + self.batch], self.src[i:i + self.batch])

    def get(self) -> None:
        for i in range(0, self.n, self.batch):
            got = self.store.get_n(self.hashes[i:i + self.batch], self.dst[i:i + self.batch])
            assert None not in got, "benchmark blocks must all hit"

    def drop_cache(self) -> None:
        """Written back and out of the page cache: the next get reads the disk."""
        drop_page_cache(self.store.tier(TierKind.SSD).slabs.path)

    def close(self) -> None:
        self.store.close(flush=False)


def drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold_time(fn, drop, reps: int) -> float:
    """Median time of fn() with the page cache dropped (untimed) before each run."""
    times = []
    for _ in range(reps):
        drop()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return nbytes / median_time(lambda: np.copyto(dst, src), reps) / 1e9


def file_gbps(nbytes: int, chunk: int, workdir: str, reps: int) -> tuple[float, float, float]:
    """Plain sequential write (no fsync, like the tier's; overwriting the file in place) and
    read of the same bytes, warm and cold."""
    path = os.path.join(workdir, "plain-file.bin")
    data = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    out = bytearray(nbytes)

    with open(path, "wb") as f:  # created once: each timed write overwrites it in place,
        f.write(data)              # as the tier overwrites its slots

    def write():
        with open(path, "r+b", buffering=0) as f:
            for off in range(0, nbytes, chunk):
                f.write(data[off:off + chunk])

    def read():
        view = memoryview(out)
        with open(path, "rb", buffering=0) as f:
            for off in range(0, nbytes, chunk):
                f.readinto(view[off:off + chunk])

    w = nbytes / median_time(write, reps) / 1e9
    r = nbytes / median_time(read, reps) / 1e9
    cold = nbytes / cold_time(read, lambda: drop_page_cache(path), reps) / 1e9
    os.unlink(path)
    return w, r, cold


def tier_rows(kind: TierKind, label: str, size_name: str, ns: Namespace, n: int, reps: int,
              workdir: str, baselines: tuple, durable: bool = True) -> list[Row]:
    base_name, base_put, base_get, *base_cold = baselines
    rows = []
    for mode, batch in (("single", 1), ("batched x16", 16)):
        case = TierCase(kind, ns, n, batch, workdir, durable)
        nbytes = n * ns.block_bytes
        put = nbytes / median_time(case.put, reps) / 1e9
        get = nbytes / median_time(case.get, reps) / 1e9
        rows.append(Row(f"{label} put {size_name} {mode}", "GB/s", put, base_name, base_put))
        rows.append(Row(f"{label} get {size_name} {mode}", "GB/s", get, base_name, base_get))
        if base_cold:
            cold = nbytes / cold_time(case.get, case.drop_cache, reps) / 1e9
            rows.append(Row(f"{label} cold get {size_name} {mode}", "GB/s", cold,
                            f"{base_name} (cold)", base_cold[0]))
        case.close()
    return rows


def hashing_rows(seed: int) -> list[Row]:
    ns = Namespace("bench", num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=16)
    toks = np.random.default_rng(seed).integers(0, 150_000, 16 * 200_000, dtype=np.int32)
    t = median_time(lambda: hash_blocks(ns, toks), 3)
    raw = toks.tobytes()
    t_raw = median_time(lambda: xxhash.xxh3_128_digest(raw), 3)
    blocks = len(toks) // 16
    return [Row("hash_blocks (16-token blocks)", "Mblocks/s", blocks / t / 1e6,
                "xxh3_128 one pass, same bytes", blocks / t_raw / 1e6)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--quick", action="store_true", help="256KiB and 1MiB only, fewer reps")
    parser.add_argument("--dir", help="where the SSD tier and the plain file live (default: a "
                        "temporary directory under ./kvtier-data, on the same disk as a real store)")
    parser.add_argument("--no-tune", action="store_true", help="leave glibc malloc as it is "
                        "(by default the bench tunes it like `kvtier serve`: kvstore/tuning.py)")
    parser.add_argument("--mib", type=int, default=32, help="MiB moved per measurement (default 32)")
    args = parser.parse_args(argv)
    if not args.no_tune:
        tune_malloc_for_large_blocks()  # as `kvtier serve` does
    torch.manual_seed(args.seed)
    sizes = {k: v for k, v in SIZES.items() if not args.quick or k in ("256KiB", "1MiB")}
    reps = 3 if args.quick else 5
    os.makedirs(args.dir or "kvtier-data", exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench-", dir=args.dir or "kvtier-data")
    gpu_label = "gpu" if default_device() == "cuda" else "gpu(cpu tensor)"
    rows = hashing_rows(args.seed)
    try:
        for size_name, size in sizes.items():
            ns = namespace_for(size)
            n = max(16, (args.mib * MiB) // size)
            copy = memcpy_gbps(n * size, reps)
            fw, fr, fc = file_gbps(n * size, size, workdir, reps)
            print(f"{size_name}: memcpy {copy:.2f} GB/s, file write {fw:.2f} / read {fr:.2f} "
                  f"/ cold read {fc:.2f} GB/s", file=sys.stderr)
            for kind, label in ((TierKind.GPU, gpu_label), (TierKind.DRAM, "dram")):
                rows += tier_rows(kind, label, size_name, ns, n, reps, workdir, ("memcpy", copy, copy))
            rows += tier_rows(TierKind.SSD, "ssd", size_name, ns, n, reps, workdir,
                              ("plain file", fw, fr, fc))
            rows += tier_rows(TierKind.SSD, "ssd(no WAL)", size_name, ns, n, reps, workdir,
                              ("plain file", fw, fr), durable=False)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report("store_tiers", rows, args.json)


if __name__ == "__main__":
    main()
