"""The SSD tier's payload files: fixed-size slots, grown by extents.

    <dir>/slabs.dat    slot i's payload at i * stride (the block size rounded up to a page)
    <dir>/headers.dat  slot i's 64-byte block header (kvstore.layout: hash, namespace,
                       checksum) at i * 64

Each byte of a block is written once (a `pwritev` of a run of consecutive slots' payloads,
then one of their headers) and read back with one `preadv` straight into the caller's
buffer, checked against the checksum the tier holds for it. The headers make every slot
self-describing: the tier's index is checked against them at open and can always be
rebuilt from them (recovery reads the header file in windows, not a slot at a time).

Headers live apart so that a payload starts at a multiple of its own size: the page cache
then keeps it in large folios. A slot of payload | header | pad (the first layout) is
never so aligned: in raw loops (hashing included, the layouts in turn in one process) its
1 MiB write ran at 0.77 of a plain file's and its warm read at 0.82, against 0.83-0.86 and
0.86-0.95 apart (256 KiB: 0.70 -> 0.81 and 0.71 -> 0.83). A directory of the first
layout (slabs.dat with no headers.dat) is not read: `old_layout` names it.

Both files grow on demand in extents of `extent_slots` slots, each reserved with
`posix_fallocate` before a slot in it is handed out: a full disk shows up as "no room to
grow" (a clean NO_SPACE for the put), never as a write that fails halfway.
"""
from __future__ import annotations

import errno
import os
import queue
import threading
from typing import Iterator, Sequence

import xxhash

from kvstore.errors import BlockFormatError, TierIOError
from kvstore.keys import Namespace
from kvstore.layout import HEADER_BYTES, checksum, decode_header, encode_header

SLABS, HEADERS = "slabs.dat", "headers.dat"
PAGE = 4096
EXTENT_BYTES = 256 << 20
INDEX_HEADROOM = 1 << 20  # disk the slab files never take: the index must still write
IOV_BLOCKS = 500  # blocks per preadv/pwritev (2 iovecs each at most, under IOV_MAX = 1024)
HASHED_RUN_BYTES = 2 << 20  # reads and writes go in runs of about a cache's worth, each run
# hashed right next to its I/O (see write_n)
HEADER_WINDOW = 4096  # headers read at once when scanning (256 KiB)
HELPED_BLOCK_BYTES = 256 << 10  # blocks this big or bigger are hashed by the helper thread
# as they are written (see _write_helped)
CHUNKED_BLOCK_BYTES = HASHED_RUN_BYTES + 1  # blocks this big or bigger are read in chunks,
CHUNK_BYTES = 512 << 10  # each hashed by the helper while the next is read (_read_chunked)


def stride_of(block_bytes: int) -> int:
    return -(-block_bytes // PAGE) * PAGE


def old_layout(directory: str) -> bool:
    """Whether `directory` holds a slab file of the first layout (headers inside it)."""
    return (os.path.isfile(os.path.join(directory, SLABS))
            and not os.path.exists(os.path.join(directory, HEADERS)))


class SlabFile:
    def __init__(self, directory: str, ns: Namespace, num_slots: int) -> None:
        self.path = os.path.join(directory, SLABS)
        self.headers_path = os.path.join(directory, HEADERS)
        self.ns, self.num_slots = ns, num_slots
        self.block_bytes = ns.block_bytes
        self.stride = stride_of(self.block_bytes)
        self.slot_disk_bytes = self.stride + HEADER_BYTES
        self.extent_slots = max(1, EXTENT_BYTES // self.stride)
        # the headers first: a directory with slabs.dat alone is of the first layout
        self.hfd = _open(self.headers_path)
        try:
            self.fd = _open(self.path)
        except BaseException:
            os.close(self.hfd)
            raise
        # slots backed by both files (a crash between their extents leaves one longer)
        self.num_grown = min(num_slots, os.fstat(self.fd).st_size // self.stride,
                             os.fstat(self.hfd).st_size // HEADER_BYTES)
        pad = self.stride - self.block_bytes
        self._pad_view = memoryview(bytes(pad)) if pad else None
        self._scratch_view = memoryview(bytearray(pad)) if pad else None
        self._run_blocks = max(1, HASHED_RUN_BYTES // self.block_bytes)

    def grow(self, min_slots: int = 1) -> range:
        """Reserve the next extent on disk (smaller ones, down to `min_slots`, when the
        disk has less room); the new slots, or an empty range at capacity. Raises
        TierIOError when not even `min_slots` fit."""
        start = self.num_grown
        n = min(self.num_slots, start + max(self.extent_slots, min_slots)) - start
        st = os.statvfs(self.path)
        n = min(n, max(0, st.f_bavail * st.f_frsize - INDEX_HEADROOM) // self.slot_disk_bytes)
        error = None if n else OSError(errno.ENOSPC, "no room left beside the index's "
                                       f"{INDEX_HEADROOM >> 10} KiB")
        while n >= min(min_slots, self.num_slots - start) and n > 0:
            try:
                os.posix_fallocate(self.hfd, start * HEADER_BYTES, n * HEADER_BYTES)
                os.posix_fallocate(self.fd, start * self.stride, n * self.stride)
            except OSError as e:
                error, n = e, n // 2
                continue
            self.num_grown = start + n
            return range(start, start + n)
        if error is None:
            return range(0)
        raise TierIOError(f"the SSD tier cannot grow {self.path} by {min_slots} slots "
                          f"({min_slots * self.slot_disk_bytes >> 10} KiB): {error}") from error

    def write_n(self, slots: Sequence[int], hashes: Sequence[bytes],
                payloads: Sequence[memoryview]) -> list[int]:
        """Write blocks (flat byte views) and their headers; returns each payload's
        checksum. Blocks of HELPED_BLOCK_BYTES and up are hashed by the helper thread while
        they are written (`_write_helped`); smaller ones in line, each pwritev of at most
        HASHED_RUN_BYTES (one block at least) hashed just before it: the bytes are still in
        cache when the kernel copies them (16 x 4 MiB hashed first and written after: ~45 us
        more per block, measured). A run's headers go after its payloads, so a crash between
        the two leaves a header that does not match the payload beside it (a miss), never
        one that vouches for bytes not there."""
        if self.block_bytes >= HELPED_BLOCK_BYTES:
            jobs = _hasher()
            if jobs is not None:
                return self._write_helped(jobs, slots, hashes, payloads)
        sums = [0] * len(payloads)
        for first, idx in _runs(slots, self._run_blocks):
            heads = []
            for i in idx:
                sums[i] = checksum(payloads[i])
                heads.append(encode_header(self.ns, hashes[i], sums[i]))
            self._io(os.pwritev, self.fd, first * self.stride,
                     _padded([payloads[i] for i in idx], self._pad_view))
            self._io(os.pwritev, self.hfd, first * HEADER_BYTES, heads)
        return sums

    def erase_headers(self, slots: Sequence[int]) -> None:
        """Zero the headers of freed slots (one pwrite per run), so that an index rebuilt
        from the headers never adopts a block that was removed (its payload is still there,
        whole, until the slot is reused). Raises TierIOError."""
        for first, idx in _runs(sorted(slots)):
            zeros = bytes(len(idx) * HEADER_BYTES)
            self._io(os.pwritev, self.hfd, first * HEADER_BYTES, [zeros])

    def read_n(self, slots: Sequence[int], sums: Sequence[int | None],
               dsts: Sequence[memoryview]) -> list[bool]:
        """Read payloads into `dsts` (flat writable byte views), each checked against the
        checksum expected of it (the one the tier holds: returned by `write_n`, taken from
        the slot's header at open; None: none is known, a miss); False where they differ
        (another block, damage, an unreadable sector). One preadv per run, no header read:
        the checksum the tier holds is what the header would say."""
        if self.block_bytes >= CHUNKED_BLOCK_BYTES:
            return self._read_chunked(slots, sums, dsts)
        ok = [False] * len(slots)
        for first, idx in _runs(slots, self._run_blocks):
            try:
                self._io(os.preadv, self.fd, first * self.stride,
                         _padded([dsts[i] for i in idx], self._scratch_view))
            except TierIOError:
                continue
            for i in idx:  # verified while the run is in cache
                ok[i] = sums[i] is not None and checksum(dsts[i]) == sums[i]
        return ok

    def _write_helped(self, jobs: queue.SimpleQueue, slots: Sequence[int],
                      hashes: Sequence[bytes], payloads: Sequence[memoryview]) -> list[int]:
        """write_n of big blocks: the helper thread hashes the batch while this one writes
        it (one pwritev per run of slots), then the headers go. Hashing runs at 2-3x the
        kernel's copy into the page cache, so it stays ahead of the write, which then reads
        the bytes from the shared cache the hash brought them into: in raw loops on a 2-core
        host, 0.93 / 0.98-1.07 / 0.98 of a plain write at 256 KiB / 1 MiB / 4 MiB, against
        0.82 / 0.82 / 0.72 hashed in line (16 KiB: 0.25, the hand-off costs more than a
        block; so smaller blocks are hashed in line)."""
        replies: queue.SimpleQueue = queue.SimpleQueue()
        jobs.put((_checksums, list(payloads), replies, None))
        try:
            for first, idx in _runs(slots):
                self._io(os.pwritev, self.fd, first * self.stride,
                         _padded([payloads[i] for i in idx], self._pad_view))
        finally:  # the helper is done with the payloads before the caller gets them back
            _, sums = replies.get()
        if sums is None:  # the helper failed (cannot happen with flat byte views): in line
            sums = [checksum(p) for p in payloads]
        for first, idx in _runs(slots):
            self._io(os.pwritev, self.hfd, first * HEADER_BYTES,
                     [encode_header(self.ns, hashes[i], sums[i]) for i in idx])
        return sums

    def _read_chunked(self, slots: Sequence[int], sums: Sequence[int | None],
                      dsts: Sequence[memoryview]) -> list[bool]:
        """read_n of big blocks: each read in CHUNK_BYTES pieces, hashed by the helper
        thread (`_hasher`) while this one reads the next (preadv and xxh3 both let go of
        the GIL); a piece is still in cache when it is hashed. 4 MiB blocks in raw loops:
        0.70 of a plain read hashed after, 0.85-0.88 pipelined (1 MiB: worse, 0.81 -> 0.68:
        the hand-off costs more than it hides, so smaller blocks go in runs)."""
        jobs = _hasher()
        if jobs is None:
            return self._read_chunked_serial(slots, sums, dsts)
        replies: queue.SimpleQueue = queue.SimpleQueue()
        read_ok, handed = [True] * len(slots), 0
        try:
            for i, (slot, dst) in enumerate(zip(slots, dsts)):
                h, base = _Digest(), slot * self.stride
                try:
                    for at in range(0, self.block_bytes, CHUNK_BYTES):
                        piece = dst[at:at + CHUNK_BYTES]
                        self._io(os.preadv, self.fd, base + at, [piece])
                        jobs.put((h.update, piece, None, None))
                except TierIOError:
                    read_ok[i] = False
                jobs.put((h.value, None, replies, i))
                handed += 1
        finally:  # the helper is done with every piece this call handed over
            ok = [False] * len(slots)
            for _ in range(handed):
                i, digest = replies.get()
                ok[i] = read_ok[i] and sums[i] is not None and digest == sums[i]
        return ok

    def _read_chunked_serial(self, slots, sums, dsts) -> list[bool]:
        ok = [False] * len(slots)
        for i, (slot, dst) in enumerate(zip(slots, dsts)):
            h, base = xxhash.xxh3_64(), slot * self.stride
            try:
                for at in range(0, self.block_bytes, CHUNK_BYTES):
                    piece = dst[at:at + CHUNK_BYTES]
                    self._io(os.preadv, self.fd, base + at, [piece])
                    h.update(piece)
            except TierIOError:
                continue
            ok[i] = sums[i] is not None and h.intdigest() == sums[i]
        return ok

    def headers(self, slots: Sequence[int]) -> Iterator[tuple[int, bytes | None, int]]:
        """(slot, block hash, checksum) of the headers found in `slots` (hash None: no valid
        header of this namespace); what recovery checks and rebuilds an index from. The
        header file is read up to HEADER_WINDOW headers at a time (sorted slots: once over)."""
        window, base, last = b"", 0, max(slots, default=0)
        for slot in slots:
            if not base <= slot < base + len(window) // HEADER_BYTES:
                base, n = slot, min(HEADER_WINDOW, last - slot + 1)
                try:
                    window = os.pread(self.hfd, n * HEADER_BYTES, slot * HEADER_BYTES)
                except OSError:
                    window = b""
            at = (slot - base) * HEADER_BYTES
            raw = window[at:at + HEADER_BYTES]
            try:
                hdr = decode_header(raw) if len(raw) == HEADER_BYTES else None
            except BlockFormatError:
                hdr = None
            good = (hdr is not None and hdr.ns_id == self.ns.ns_id
                    and hdr.shape == self.ns.block_shape)
            yield slot, (hdr.block_hash if good else None), (hdr.checksum if good else 0)

    def _io(self, fn, fd: int, offset: int, bufs: list) -> None:
        """One pwritev/preadv of `bufs` at `offset` of `fd`, continued until every byte moved."""
        if len(bufs) == 1:  # one block with no pad, or one run's headers: in one call, as a
            try:  # rule (a short transfer redoes the whole call below: it is positional)
                if fn(fd, bufs, offset) == memoryview(bufs[0]).nbytes:
                    return
            except OSError as e:
                raise TierIOError(f"SSD tier I/O on {self._name(fd)} failed: {e}") from e
        views = [v if isinstance(v, memoryview) else memoryview(v) for v in bufs if len(v)]
        while views:
            try:
                n = fn(fd, views[:1024], offset)
            except OSError as e:
                raise TierIOError(f"SSD tier I/O on {self._name(fd)} failed: {e}") from e
            if n == 0:
                raise TierIOError(f"SSD tier I/O on {self._name(fd)} hit the end of the file")
            offset += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]

    def _name(self, fd: int) -> str:
        return self.headers_path if fd == self.hfd else self.path

    def truncate_to(self, num_slots: int) -> None:
        """Give back disk beyond `num_slots` (a reopen with less capacity)."""
        for fd, size in ((self.fd, self.stride), (self.hfd, HEADER_BYTES)):
            if os.fstat(fd).st_size > num_slots * size:
                os.ftruncate(fd, num_slots * size)
        self.num_grown = min(self.num_grown, num_slots)

    def close(self) -> None:
        for name in ("fd", "hfd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


_HASHER: tuple[int, queue.SimpleQueue] | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> queue.SimpleQueue | None:
    """The job queue of the process's hashing helper (a daemon thread, started on first use
    and again in a forked child); None where no thread can be started (hash in line).
    A job is (function, argument or None for no argument, reply queue or None, tag); the
    helper calls it and, given a queue, answers (tag, result), result None where it raised.
    One helper serves every caller: a caller's jobs keep their order, and it waits for its
    own replies only."""
    global _HASHER
    current = _HASHER
    if current is not None and current[0] == os.getpid():
        return current[1]
    with _HASHER_LOCK:
        if _HASHER is None or _HASHER[0] != os.getpid():
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            try:
                threading.Thread(target=_run_jobs, args=(jobs,), name="kvtier-ssd-hash",
                                 daemon=True).start()
            except RuntimeError:  # interpreter shutting down, or no threads left
                return None
            _HASHER = (os.getpid(), jobs)
        return _HASHER[1]


def _run_jobs(jobs: queue.SimpleQueue) -> None:
    while True:
        fn, arg, reply, tag = jobs.get()
        try:
            result = fn() if arg is None else fn(arg)
        except Exception:  # noqa: BLE001 - answered as None; the helper lives on
            result = None
        if reply is not None:
            reply.put((tag, result))


def _checksums(payloads: list) -> list[int]:
    return [checksum(p) for p in payloads]


class _Digest:
    """A streaming xxh3_64 (the same value as `checksum` of the whole) fed in pieces; a
    piece that cannot be added makes the value None, which matches no checksum."""
    __slots__ = ("_h", "_failed")

    def __init__(self) -> None:
        self._h, self._failed = xxhash.xxh3_64(), False

    def update(self, piece) -> None:
        try:
            self._h.update(piece)
        except Exception:  # noqa: BLE001 - that block is a miss
            self._failed = True

    def value(self) -> int | None:
        return None if self._failed else self._h.intdigest()


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise TierIOError(f"cannot open the SSD slab file {path}: {e}") from e


def _padded(payloads: list, pad: memoryview | None) -> list:
    """A run's payload iovecs, each followed by the pad to its page-rounded stride."""
    if pad is None:
        return payloads
    return [v for payload in payloads for v in (payload, pad)]


def _runs(slots: Sequence[int], most: int = IOV_BLOCKS) -> list[tuple[int, list[int]]]:
    """(first slot, batch indices) of each run of consecutive slots, `most` (at most
    IOV_BLOCKS) blocks long at most."""
    most = min(most, IOV_BLOCKS)
    runs: list[tuple[int, list[int]]] = []
    for i, slot in enumerate(slots):
        if runs and slot == runs[-1][0] + len(runs[-1][1]) and len(runs[-1][1]) < most:
            runs[-1][1].append(i)
        else:
            runs.append((slot, [i]))
    return runs
