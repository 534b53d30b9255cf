"""Put / get throughput of each store tier against a baseline measured in the same run.

GPU and DRAM tiers are compared with a plain memcpy (single-threaded, numpy) of the same
bytes; the SSD tier with a plain sequential file write / read of the same bytes in the same
directory, warm (from the page cache) and cold (both files written back and dropped from
the page cache with fdatasync + POSIX_FADV_DONTNEED before every read), and also with a
plain file that checksums each block (xxh3_64, as the tier must: the floor of its promise
that a corrupted block is a miss). Each tier row and its baselines are timed in turn
(`paired_times`), every SSD run starting with nothing dirty in the page cache. Each
measurement moves `--mib` MiB (by default twice the largest CPU cache), so that both sides
copy from and to memory, not from a cache one of them happens to have warmed.
On a machine without CUDA the GPU tier runs on a CPU tensor (and says so). Also reports
block-hashing throughput against one xxh3_128 pass over the same token bytes.

    python bench/store_tiers.py [--quick] [--json PATH] [--dir DIR]
"""
from __future__ import annotations

import argparse
from functools import partial
import glob
import os
import shutil
import statistics
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
from kvstore.tiers.slabfile import CHUNK_BYTES, CHUNKED_BLOCK_BYTES, WRITE_RUN_BYTES
from kvstore.tuning import freeze_gc_heap, tune_malloc_for_large_blocks

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"16KiB": 16 * KiB, "256KiB": 256 * KiB, "1MiB": MiB, "4MiB": 4 * MiB}


def largest_cpu_cache() -> int:
    """Bytes of the host's largest CPU cache (sysfs; 32 MiB where it cannot be read)."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index) as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": KiB, "M": MiB}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=32 * MiB)


def default_mib() -> int:
    """MiB moved per measurement: twice the largest CPU cache, 64 at least. With less, the
    warm rows measure the cache, not the tier: on a host with a 32 MiB L3, a 32 MiB run of
    1 MiB plain-file reads ran at 11-15 GB/s and the tier's at 8-10, in cache or not from
    run to run (ratios 0.60-0.83 on the same code), while at 64 MiB both read from memory
    at 5-6.6 GB/s and the ratios held within 0.74-0.85 (4 MiB rows, which move 16 blocks,
    64 MiB, at least: 0.81-0.85, where 32 MiB of the smaller sizes before them had left
    them at 0.52-1.49)."""
    return max(64, 2 * largest_cpu_cache() // MiB)


ROUNDS = 16  # distinct sets of blocks a TierCase puts in turn (a set is gone from its 2n
# slots two puts later: each put of n fresh blocks evicts the n least recent)


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


def paired_times(fn, bases, reps: int, before=None) -> tuple[float, list[float]]:
    """Median times of `fn` and of each of its baselines, run in turn (one run of each per
    round, in a rotating order; `before`, a function per run, untimed ahead of it: e.g.
    dropping the page cache), so a shared host's slow spell weighs on both sides alike."""
    fns = [fn, *bases]
    for f in fns:
        f()  # warm-up: first touch of buffers, RocksDB memtables, thread pools
    times: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        for k in range(len(fns)):
            i = (k + r) % len(fns)  # each round starts with the next one: no side always
            if before is not None:  # runs right after the same other
                before[i]()
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    med = [statistics.median(t) for t in times]
    return med[0], med[1:]


class TierCase:
    """A one-tier store of 2n slots; every put writes n fresh blocks (evicting old ones)."""

    def __init__(self, kind: TierKind, ns: Namespace, n: int, batch: int, workdir: str,
                 durable: bool) -> None:
        self.ns, self.n, self.batch = ns, n, batch
        path = os.path.join(workdir, f"ssd-{ns.block_bytes}-{batch}-{durable}")
        cfg = TierConfig(kind, 2 * n, path=path if kind is TierKind.SSD else None, durable=durable)
        self.store = TieredStore(ns, StoreConfig((cfg,), promote_on_hit=False))
        # numpy-allocated like the baselines' buffers (numpy asks for huge pages for large
        # arrays, torch's CPU allocator does not: a 1 MiB copy or hash differs by up to 2x)
        self.src = torch.from_numpy(np.asarray(torch.randint(0, 256, (n, ns.block_bytes),
                                                             dtype=torch.uint8)).copy())
        self.dst = torch.from_numpy(np.empty((n, ns.block_bytes), np.uint8))
        self.round = 0
        self.hashes: list[bytes] = []
        # each round's block hashes made here, untimed: a caller of the tier brings them
        # (the engine hashes its tokens), and the baselines compute nothing of the kind
        span = self.n * ns.block_tokens
        self.round_hashes = [hash_blocks(ns, np.arange(span) + r * 10**7) for r in range(ROUNDS)]

    def put(self) -> None:
        self.round += 1
        self.hashes = self.round_hashes[self.round % ROUNDS]
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


class Memcpy:
    """The memory tiers' baseline: a single-threaded numpy copy of the same bytes."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.empty_like(self.src)

    def write(self) -> None:
        np.copyto(self.dst, self.src)

    read = write

    def close(self) -> None:
        pass


class PlainFile:
    """The SSD tier's baseline: a plain sequential write (no fsync, like the tier's;
    overwriting the file in place, as the tier overwrites its slots) and read of the same
    bytes in `chunk`-sized calls, in the same directory; with `checksum`, also an xxh3_64
    of each chunk (what the tier must add to keep its promise that corruption is a miss),
    the way that costs least here: each chunk hashed right after its write or read, while
    the kernel's copy has left it in cache, as the tier does it: a write bigger than
    WRITE_RUN_BYTES in pieces of that, a read of CHUNKED_BLOCK_BYTES or more in CHUNK_BYTES
    pieces (kvstore.tiers.slabfile's write_n says why)."""

    def __init__(self, nbytes: int, chunk: int, workdir: str, checksum: bool = False) -> None:
        self.path = os.path.join(workdir, f"plain-file-{checksum}.bin")
        self.nbytes, self.chunk, self.checksum = nbytes, chunk, checksum
        self.data = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
        self.out = memoryview(np.empty(nbytes, np.uint8))
        with open(self.path, "wb") as f:  # created once: each timed write overwrites it
            f.write(self.data)

    def write(self) -> None:
        self._pass("r+b", self.data, lambda f: f.write, WRITE_RUN_BYTES + 1, WRITE_RUN_BYTES)

    def read(self) -> None:
        self._pass("rb", self.out, lambda f: f.readinto, CHUNKED_BLOCK_BYTES, CHUNK_BYTES)

    def _pass(self, mode: str, buf: memoryview, io_of, split_from: int, piece: int) -> None:
        """One pass over the file, chunk by chunk: `io_of(file)` writes or reads a piece."""
        with open(self.path, mode, buffering=0) as f:
            io = io_of(f)
            for off in range(0, self.nbytes, self.chunk):
                block = buf[off:off + self.chunk]
                if not self.checksum:
                    io(block)
                    continue
                h = xxhash.xxh3_64()
                pieces = ([block] if len(block) < split_from else
                          [block[at:at + piece] for at in range(0, len(block), piece)])
                for p in pieces:
                    io(p)
                    h.update(p)
                h.intdigest()

    def drop_cache(self) -> None:
        drop_page_cache(self.path)

    def close(self) -> None:
        os.unlink(self.path)


def tier_rows(kind: TierKind, label: str, size_name: str, ns: Namespace, n: int, reps: int,
              workdir: str, bases: list, durable: bool = True, cold: bool = False) -> list[Row]:
    """Put, get (and cold get) rows of one tier, one row per (baseline factory, its name) in
    `bases`, each baseline measured in turn with the tier (`paired_times`).

    Each mode gets a fresh store and fresh baselines: a file's warm reads depend on how its
    pages came into the cache (written whole: 9.2-10.3 GB/s here; read back by readahead
    after a cold run: 6.6-8.7, and still after overwriting it), so a baseline kept across
    modes was a fresh file for the single rows and a read-back one for the x16 rows, which
    faced a fresh store every time."""
    rows = []
    nbytes = n * ns.block_bytes
    gbps = nbytes / 1e9
    for mode, batch in (("single", 1), ("batched x16", 16)):
        case = TierCase(kind, ns, n, batch, workdir, durable)
        made = []
        try:
            for make, name in bases:
                made.append((make(), name))
            rows += _mode_rows(kind, f"{size_name} {mode}", label, case, made, gbps, reps, cold)
        finally:
            for b, _ in made:
                b.close()
            case.close()
    return rows


def _mode_rows(kind: TierKind, what: str, label: str, case: TierCase, bases: list, gbps: float,
               reps: int, cold: bool) -> list[Row]:
    rows = []
    # every run starts with nothing dirty in the page cache (written back untimed), so no
    # run pays for the writeback of the one before it
    settle = [os.sync] * (1 + len(bases)) if kind is TierKind.SSD else None
    for op, fn, base_fn in (("put", case.put, "write"), ("get", case.get, "read")):
        t, base_ts = paired_times(fn, [getattr(b, base_fn) for b, _ in bases], reps,
                                  before=settle)
        rows += [Row(f"{label} {op} {what}", "GB/s", gbps / t, name, gbps / bt)
                 for (_, name), bt in zip(bases, base_ts)]
    if cold:
        drops = [case.drop_cache] + [b.drop_cache for b, _ in bases]
        t, base_ts = paired_times(case.get, [b.read for b, _ in bases], reps, before=drops)
        rows += [Row(f"{label} cold get {what}", "GB/s", gbps / t, f"{name} (cold)", gbps / bt)
                 for (_, name), bt in zip(bases, base_ts)]
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
    parser.add_argument("--mib", type=int, default=default_mib(),
                        help="MiB moved per measurement (default: twice the largest CPU cache, "
                        "64 at least: %(default)s here), at least 16 blocks")
    parser.add_argument("--sizes", help="comma-separated block sizes to measure, of "
                        f"{','.join(SIZES)} (default: all; with --quick, 256KiB,1MiB)")
    args = parser.parse_args(argv)
    chosen = args.sizes.split(",") if args.sizes else (
        ["256KiB", "1MiB"] if args.quick else list(SIZES))
    unknown = [name for name in chosen if name not in SIZES]
    if unknown:
        parser.error(f"unknown --sizes {','.join(unknown)}: choose from {','.join(SIZES)}")
    if not args.no_tune:
        tune_malloc_for_large_blocks()  # as `kvtier serve` does
    torch.manual_seed(args.seed)
    sizes = {k: SIZES[k] for k in chosen}
    reps = 7 if args.quick else 11  # a 64 MiB run is ~10 ms: medians of many
    os.makedirs(args.dir or "kvtier-data", exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench-", dir=args.dir or "kvtier-data")
    gpu_label = "gpu" if default_device() == "cuda" else "gpu(cpu tensor)"
    rows = hashing_rows(args.seed)
    # As bench.store_service, `kvtier serve` and an engine once loaded: the setup's heap
    # (torch's above all) out of the cyclic GC. A full pass over it took 60-85 ms (a gc
    # callback in the single 256 KiB SSD put loop), longer than a whole 32 MiB run, and
    # landed on the tier's side: the store's entries and events allocate, the plain-file
    # loop hardly does.
    freeze_gc_heap()
    try:
        for size_name, size in sizes.items():
            ns = namespace_for(size)
            n = max(16, (args.mib * MiB) // size)
            copy = partial(Memcpy, n * size)
            for kind, label in ((TierKind.GPU, gpu_label), (TierKind.DRAM, "dram")):
                rows += tier_rows(kind, label, size_name, ns, n, reps, workdir,
                                  [(copy, "memcpy")])
            plain = partial(PlainFile, n * size, size, workdir)
            summed = partial(PlainFile, n * size, size, workdir, checksum=True)
            rows += tier_rows(TierKind.SSD, "ssd", size_name, ns, n, reps, workdir,
                              [(plain, "plain file"), (summed, "plain file + xxh3")], cold=True)
            rows += tier_rows(TierKind.SSD, "ssd(no WAL)", size_name, ns, n, reps, workdir,
                              [(plain, "plain file")], durable=False)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report("store_tiers", rows, args.json)


if __name__ == "__main__":
    main()
