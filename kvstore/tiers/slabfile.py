"""The SSD tier's payload files: fixed-size slots, grown by extents.

    <dir>/slabs.dat    slot i's payload at i * stride (the block size rounded up to a page)
    <dir>/headers.dat  slot i's 64-byte block header (kvstore.layout: hash, namespace,
                       checksum) at i * 64

Each byte of a block is written once (a `pwritev` of a run of consecutive slots' payloads,
then one of their headers) and read back with one `preadv` straight into the caller's
buffer, checked against the checksum the tier holds for it (a block of 512 KiB or more is
written and read in 256 KiB pieces, each hashed next to its own call, while it is still in
cache, and a batch of them has its headers written after all its payloads). The
payload calls and their hashing run in C where kvstore/tiers/_slabio.c was built (NATIVE),
one call per run of consecutive slots with the GIL released: what Python spent around each
call was ~4-8% of a 1 or 4 MiB block's put or get (paired in one process, 2-vCPU Xeon VM:
1 MiB single put 3.42 -> 3.56 GB/s, get 4.01 -> 4.18; x16 get 4.27 -> 4.61). The
headers make every slot self-describing: the tier's index is checked against them at open
and can always be rebuilt from them (recovery reads the header file in windows, not a slot
at a time).

Headers live apart so that a payload starts at a multiple of its own size: the page cache
then keeps it in large folios. A slot of payload | header | pad (the first layout) is
never so aligned: in raw loops (hashing included, the layouts in turn in one process) its
1 MiB write ran at 0.77 of a plain file's and its warm read at 0.82, against 0.83-0.86 and
0.86-0.95 apart (256 KiB: 0.70 -> 0.81 and 0.71 -> 0.83). A directory of the first
layout (slabs.dat with no headers.dat) is not read: `old_layout` names it.

Both files grow on demand in extents, each reserved with `posix_fallocate` before a slot
in it is handed out: a full disk shows up as "no room to grow" (a clean NO_SPACE for the
put), never as a write that fails halfway. The first extent is FIRST_EXTENT_BYTES, each
next one as big as the file already is, up to EXTENT_BYTES: a namespace of a few blocks
takes a few MiB of disk, not 256 (a test suite's hundred small tiers took gigabytes, and
filled the disk of a CI run).
"""
from __future__ import annotations

import collections
import errno
import os
import threading
from typing import Iterator, Sequence

import xxhash

from kvstore.errors import BlockFormatError, TierIOError
from kvstore.keys import Namespace
from kvstore.layout import HEADER_BYTES, HeaderEncoder, checksum, decode_header

try:  # the payload I/O and its hashing in C (kvstore/tiers/_slabio.c), where it was built
    import xxhash._xxhash

    from kvstore.tiers import _slabio
    NATIVE = _slabio.bind(xxhash._xxhash.__file__)
except (ImportError, AttributeError):
    _slabio, NATIVE = None, False

SLABS, HEADERS = "slabs.dat", "headers.dat"
# written beside the files by every open of a tier of this layout: a directory with it is
# never taken for the first layout, whatever its payload bytes look like (`old_layout`)
LAYOUT, LAYOUT_TEXT = "layout", "slab payloads, headers.dat apart\n"
RESTORING = ".restoring"  # headers.dat + this: lost headers being written again
PAGE = 4096
EXTENT_BYTES = 256 << 20  # the largest extent
FIRST_EXTENT_BYTES = 8 << 20
INDEX_HEADROOM = 1 << 20  # disk the slab files never take, per SSD tier open on the same
# filesystem: each tier's index must still write, and open (RocksDB writes a MANIFEST, an
# OPTIONS file, a WAL and its LOG at every open). One MiB for all of them let eight
# namespaces fill a disk to its last 12 KiB, and the next start opened none of them.
_open_on: collections.Counter[int] = collections.Counter()  # writable slab files per st_dev
_open_lock = threading.Lock()
ZERO_HEADER = bytes(HEADER_BYTES)  # a freed slot's
IOV_BLOCKS = 500  # blocks per preadv/pwritev (2 iovecs each at most, under IOV_MAX = 1024)
HASHED_RUN_BYTES = 256 << 10  # reads and writes go in runs of about a cache's worth, each
# run hashed right next to its I/O (see write_n). 2 MiB -> 256 KiB on a Xeon VM (2 MiB L2),
# of a plain file's: 256 KiB x16 gets 0.59 -> 0.70, puts 0.60 -> 0.65; 1 MiB x16 puts
# 0.74 -> 0.76; 16 KiB rows unchanged (a x16 batch of them is one run either way)
HEADER_WINDOW = 4096  # headers read at once when scanning (256 KiB)
CHUNKED_BLOCK_BYTES = 2 * HASHED_RUN_BYTES  # blocks this big or bigger are read in chunks,
CHUNK_BYTES = HASHED_RUN_BYTES  # each hashed right after its own preadv
WRITE_RUN_BYTES = 1 << 20  # writes go in runs of blocks, or pieces of a bigger block, of
# this, each hashed right after its pwritev (see write_n: 256 KiB had been the reads')


def stride_of(block_bytes: int) -> int:
    return -(-block_bytes // PAGE) * PAGE


def old_layout(directory: str, ns: Namespace) -> bool:
    """Whether `directory` holds a slab file of the first layout (each slot's header inside
    it, after the payload, slots page-rounded with it): a slabs.dat with no headers.dat
    whose first slots show such a header (any: one torn by a crash, or another namespace's
    that reopened the directory, still says so). With none, it is a current tier whose
    headers.dat was lost (`headers_missing`). Where the first layout kept a header the
    current one keeps payload bytes, a tenant's own: a directory with the LAYOUT file,
    which every open of the current layout writes, is of the current layout, whatever its
    bytes (one whose blocks began like a header was set aside and started empty)."""
    block_bytes = ns.block_bytes
    path = os.path.join(directory, SLABS)
    if not os.path.isfile(path) or os.path.exists(os.path.join(directory, HEADERS)) \
            or os.path.exists(os.path.join(directory, LAYOUT)):
        return False
    old_stride = stride_of(block_bytes + HEADER_BYTES)
    try:
        with open(path, "rb") as f:
            for slot in range(64):
                f.seek(slot * old_stride + block_bytes)
                raw = f.read(HEADER_BYTES)
                if len(raw) < HEADER_BYTES:
                    break
                try:
                    decode_header(raw)
                    return True
                except BlockFormatError:
                    continue
    except OSError:
        return True  # unreadable: not read as ours either
    return False


def _mark_layout(directory: str) -> None:
    """The LAYOUT file, where it is not yet (a tier made before it was written gets it at
    its next open: its headers.dat, or the open's restore of it, says it is of this
    layout). Best effort: without it, `old_layout` still looks at the bytes."""
    path = os.path.join(directory, LAYOUT)
    if os.path.exists(path):
        return
    try:
        with open(path + ".tmp", "w") as f:
            f.write(LAYOUT_TEXT)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # (a full disk: the next open writes it)


def headers_missing(directory: str) -> bool:
    """A slab file with payloads and no header file beside it (deleted, or lost to a
    damaged disk): the tier writes the headers again from its index (`restore_headers`)."""
    path = os.path.join(directory, SLABS)
    return (os.path.isfile(path) and os.path.getsize(path) > 0
            and not os.path.exists(os.path.join(directory, HEADERS)))


class SlabFile:
    def __init__(self, directory: str, ns: Namespace, num_slots: int,
                 readonly: bool = False) -> None:
        """`readonly` (a check: `kvtier fsck`): both files opened for reading only, neither
        created (TierIOError when one is missing)."""
        self._dev: int | None = None  # (counted in _open_on while open for writing)
        self.headers_missing = headers_missing(directory)  # (before opening creates it)
        self.path = os.path.join(directory, SLABS)
        self.headers_path = os.path.join(directory, HEADERS)
        self.ns, self.num_slots = ns, num_slots
        self.block_bytes = ns.block_bytes
        self.stride = stride_of(self.block_bytes)
        self.slot_disk_bytes = self.stride + HEADER_BYTES
        # the headers first: a directory with slabs.dat alone is of the first layout. Lost
        # ones are rebuilt in a file of their own, renamed into place once whole: an open
        # that fails midway leaves headers.dat missing still (the next open restores it),
        # never empty (which would say every slot is free)
        if readonly:
            self.hfd = _open(self.headers_path, readonly=True)
        elif self.headers_missing:
            self.hfd = _open(self.headers_path + RESTORING, os.O_TRUNC)
        else:
            self.hfd = _open(self.headers_path)
        try:
            self.fd = _open(self.path, readonly=readonly)
        except BaseException:
            os.close(self.hfd)
            raise
        if not readonly:
            _mark_layout(directory)
            self._dev = os.fstat(self.fd).st_dev
            with _open_lock:
                _open_on[self._dev] += 1
        # slots backed by both files (a crash between their extents leaves one longer)
        self.num_grown = min(num_slots, os.fstat(self.fd).st_size // self.stride,
                             os.fstat(self.hfd).st_size // HEADER_BYTES)
        pad = self.stride - self.block_bytes
        self._pad_view = memoryview(bytes(pad)) if pad else None
        self._scratch_view = memoryview(bytearray(pad)) if pad else None
        self._run_blocks = max(1, HASHED_RUN_BYTES // self.block_bytes)
        self._write_run_blocks = max(1, WRITE_RUN_BYTES // self.block_bytes)
        self._header = HeaderEncoder(ns)
        # payload writes and reads in flight: close() waits for them, so none of them ever
        # reaches a descriptor number closed under it and reused by another file (the C
        # path holds the number for a whole run: a close mid-run sent the rest of it, up
        # to 19 MiB, into a file opened meanwhile)
        # (its lock taken alone by _enter and _leave, a C-level `with`: one over the
        # Condition, its Python __enter__/__exit__, took 0.80 us warm against 0.33)
        self._gate_lock = threading.Lock()
        self._gate, self._busy, self._closing = threading.Condition(self._gate_lock), 0, False

    def grow(self, min_slots: int = 1) -> range:
        """Reserve the next extent on disk (smaller ones, down to `min_slots`, when the
        disk has less room); the new slots, or an empty range at capacity. Raises
        TierIOError when not even `min_slots` fit."""
        start = self.num_grown
        extent = min(EXTENT_BYTES, max(FIRST_EXTENT_BYTES, start * self.stride))
        n = min(self.num_slots, start + max(extent // self.stride, 1, min_slots)) - start
        st = os.statvfs(self.path)
        with _open_lock:
            headroom = INDEX_HEADROOM * max(1, _open_on[self._dev])
        n = min(n, max(0, st.f_bavail * st.f_frsize - headroom) // self.slot_disk_bytes)
        # (room for fewer than `min_slots` is no room: an empty range says "at capacity",
        # and a caller told that while it could still grow would ask again for ever)
        error = (None if n >= min(min_slots, self.num_slots - start) else
                 OSError(errno.ENOSPC, f"room for {n} slots beside the {headroom >> 10} KiB "
                         "kept for the indexes of the SSD tiers on this disk"))
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
        checksum. Blocks go in pwritevs of at most WRITE_RUN_BYTES, a run of consecutive
        slots or a piece of a bigger block, each hashed right after its pwritev, while the
        kernel's copy has left it in cache. Headers go after the payloads they vouch for (a
        run's after the run; a batch of big blocks' after all of the batch), so a crash
        between the two leaves a header that does not match the payload beside it (a
        miss), never one that vouches for bytes not there.

        The run's size is the host's cache hierarchy's call, measured against a plain
        file's writes of the same bytes:
        - an EPYC VM (512 KiB L2), through _slabio, 64 MiB a pass: 4 MiB blocks in 64 /
          256 KiB / 1 MiB pieces 0.54-0.62 / 0.72-0.74 / 0.82-0.83, whole 0.76, hashed
          whole then written 0.75-0.79; 1 MiB blocks in 256 KiB pieces 0.73, whole 0.84-
          0.85; 256 KiB blocks x16 in runs of 1 / 4 / 16 blocks 0.89 / 0.96 / 0.89. Its
          pwritev costs enough a call that fewer, bigger ones win, and the bytes hashed
          after one are still in its L3. Through this tier's write_n (its Python and
          headers included; 12 passes taking turns, medians), 256 KiB -> 1 MiB runs:
          4 MiB x16 0.76 -> 0.80 and 0.83 -> 0.85, 1 MiB x16 0.76 -> 0.79 and 0.68 ->
          0.73, 256 KiB x16 0.77 -> 0.80, single 4 and 1 MiB puts +1-3%.
        - a Xeon VM (2 MiB L2), raw Python loops: 4 MiB blocks hashed whole then written
          0.71, written whole then hashed 0.70, in 256 KiB pieces each hashed after its
          write 0.89; 1 MiB blocks whole 0.83, in 256 KiB pieces 0.85. 256 KiB pieces were
          used from there until the EPYC figures above; 1 MiB costs that host little
          (1 MiB blocks) and gains the other a tenth.

        All in the calling thread. A helper thread hashing beside the I/O was tried: on one
        host (Xeon, hashing ~2x slower than the kernel's copy) it took 4 MiB x16 puts from
        0.68 to 0.98 of a plain file; on another (EPYC VM, hashing from cache at ~110 GB/s)
        each hand-off cost 20-45 us (a 256 KiB put 70 -> 116 us, a 4 MiB read 0.83 -> 0.68),
        and with both cores busy it lost everywhere (4 MiB get 1.0 -> 1.6 ms). Tried again
        in _slabio's C (EPYC VM, 1 MiB L2): a helper pthread hashing each block of the call
        while this thread wrote them, the caller hashing whatever the helper had not
        started and spinning, not sleeping, for the rest. Raw calls against a plain file:
        single 1 and 4 MiB blocks 0.73-0.86 -> 0.68-0.78, x16 mixed (1 MiB 0.77-0.85 ->
        0.65-0.87, 4 MiB 0.76-0.82 -> 0.73-0.92), 64 blocks a call 0.85-0.90 -> 1.01-1.03;
        through this tier, single and x16 puts no better. The helper's hash, reading from
        memory beside the write, took ~108 us a 1 MiB block (~35 in line, from the cache the
        kernel's copy leaves) and slowed that copy by about what it saved (the 1 MiB write
        ~215 -> ~275 us): only a helper far ahead of the writes, over a long batch, pulls
        the bytes into L3 for them and gains. Handing a helper the whole call, writes and
        hashes (this thread's caches kept for the Python around it), lost as well, through
        this tier against a plain file: 1 MiB single puts 0.60-0.65 -> 0.51-0.55 and x16
        0.66-0.73 -> 0.60-0.62 with this thread asleep meanwhile (4 MiB about even); with
        it spinning, every row 0.37-0.43 (the spinning vCPU slowed the other's copy).

        Where kvstore.tiers._slabio was built (NATIVE), each run of consecutive slots is
        written and hashed the same way in one call to it, the GIL released throughout.
        TierIOError once the file is closed."""
        if not self._enter():
            raise TierIOError(f"the SSD tier's slab file {self.path} is closed")
        try:
            if NATIVE:
                return self._write_native(slots, hashes, payloads)
            if self.block_bytes > WRITE_RUN_BYTES:
                return self._write_chunked(slots, hashes, payloads)
            return self._write_runs(slots, hashes, payloads)
        finally:
            self._leave()

    def _enter(self) -> bool:
        """One more payload call in flight (False, and none, once the file is closing)."""
        with self._gate_lock:
            if self._closing:
                return False
            self._busy += 1
            return True

    def _leave(self) -> None:
        with self._gate_lock:
            self._busy -= 1
            if not self._busy and self._closing:  # (set under this lock: close() waits)
                self._gate.notify_all()

    def _write_runs(self, slots: Sequence[int], hashes: Sequence[bytes],
                    payloads: Sequence[memoryview]) -> list[int]:
        """write_n of blocks in Python: a pwritev per run of WRITE_RUN_BYTES, its blocks
        hashed right after it, then their headers."""
        sums = [0] * len(payloads)
        for first, idx in _runs(slots, self._write_run_blocks):
            self._io(os.pwritev, self.fd, first * self.stride,
                     _padded([payloads[i] for i in idx], self._pad_view))
            heads = []
            for i in idx:
                sums[i] = checksum(payloads[i])
                heads.append(self._header(hashes[i], sums[i]))
            self._io(os.pwritev, self.hfd, first * HEADER_BYTES, heads)
        return sums

    def _write_chunked(self, slots: Sequence[int], hashes: Sequence[bytes],
                       payloads: Sequence[memoryview]) -> list[int]:
        """write_n of blocks bigger than WRITE_RUN_BYTES: each in pieces of that (the last
        one with the slot's pad), each hashed right after its pwritev; the headers after
        all the payloads, one pwritev per run of consecutive slots."""
        sums, step = [], WRITE_RUN_BYTES
        for slot, payload in zip(slots, payloads):
            h, base = xxhash.xxh3_64(), slot * self.stride
            for at in range(0, self.block_bytes, step):
                piece = payload[at:at + step]
                last = at + step >= self.block_bytes and self._pad_view is not None
                self._io(os.pwritev, self.fd, base + at, [piece, self._pad_view] if last else [piece])
                h.update(piece)
            sums.append(h.intdigest())
        self._write_heads(hashes, sums, _runs(slots))
        return sums

    def _write_native(self, slots: Sequence[int], hashes: Sequence[bytes],
                      payloads: Sequence[memoryview]) -> list[int]:
        """write_n through _slabio: a run of consecutive slots per call, its headers
        written by the same call once its payloads are (their checksums filled in there:
        the header pwritev and its Python, ~10-18 us of a single 1 MiB put, now ~3-5 us)."""
        piece = WRITE_RUN_BYTES if self.block_bytes > WRITE_RUN_BYTES else 0
        if len(slots) == 1:  # a single block's put (no runs to find)
            return self._write_run(slots[0], hashes, payloads, piece, True)
        sums = [0] * len(payloads)
        runs = _runs(slots)
        # big blocks in more than one run: every header after every payload of the batch,
        # as _write_chunked (a run the disk refuses leaves no header of the runs before it)
        apart = bool(piece) and len(runs) > 1
        for first, idx in runs:
            got = self._write_run(first, [hashes[i] for i in idx], [payloads[i] for i in idx],
                                  piece, not apart)
            for i, c in zip(idx, got):
                sums[i] = c
        if apart:
            self._write_heads(hashes, sums, runs)
        return sums

    def _write_run(self, first: int, hashes: Sequence[bytes], payloads: Sequence[memoryview],
                   piece: int, heads: bool) -> list[int]:
        """One run of consecutive slots in one _slabio call, with its headers (`heads`)."""
        try:
            if not heads:
                return _slabio.write_blocks(self.fd, first * self.stride, payloads,
                                            self.stride, self._write_run_blocks, piece)
            return _slabio.write_blocks(self.fd, first * self.stride, payloads, self.stride,
                                        self._write_run_blocks, piece, self.hfd,
                                        self._header.blanks(hashes))
        except OSError as e:
            raise TierIOError(f"SSD tier I/O on {self.path} or its headers failed: {e}") from e

    def _write_heads(self, hashes: Sequence[bytes], sums: list[int],
                     runs: list[tuple[int, list[int]]]) -> None:
        """The headers of `runs` (emptied): one pwritev per run of consecutive slots."""
        for first, idx in runs:
            self._io(os.pwritev, self.hfd, first * HEADER_BYTES,
                     [self._header(hashes[i], sums[i]) for i in idx])
        runs.clear()

    def restore_headers(self, entries: Sequence[tuple[bytes, int, int]]) -> int:
        """Write the headers of a slab file that lost its header file, from the index's
        (hash, slot, checksum) entries; returns how many. A slot two entries name (one of
        them stale: a delete a crash cut off) gets the one its payload matches, if any.
        Payloads are checked on every read as ever: an entry that lies reads as a miss."""
        slab_slots = min(self.num_slots, os.fstat(self.fd).st_size // self.stride)
        by_slot: dict[int, list[tuple[bytes, int]]] = {}
        for h, slot, c in entries:
            if slot < slab_slots:
                by_slot.setdefault(slot, []).append((h, c))
        buf = memoryview(bytearray(self.block_bytes))
        items = []
        os.ftruncate(self.hfd, slab_slots * HEADER_BYTES)  # (opened empty: O_TRUNC)
        for slot in sorted(by_slot):
            named = by_slot[slot]
            if len(named) > 1:
                named = [(h, c) for h, c in named if self.read_n([slot], [c], [buf])[0]][:1]
            items += [(slot, h, c) for h, c in named]
        self.write_headers(items)
        os.fsync(self.hfd)
        os.rename(self.headers_path + RESTORING, self.headers_path)
        _fsync_dir(os.path.dirname(self.headers_path))
        self.num_grown = slab_slots
        self.headers_missing = False
        return len(items)

    def write_headers(self, items: Sequence[tuple[int, bytes, int]]) -> None:
        """Write the headers of (slot, block hash, checksum) again (ones found damaged).
        Raises TierIOError."""
        for slot, h, c in items:
            self._io(os.pwritev, self.hfd, slot * HEADER_BYTES, [self._header(h, c)])

    def erase_headers(self, slots: Sequence[int]) -> None:
        """Zero the headers of freed slots (one pwrite per run), so that an index rebuilt
        from the headers never adopts a block that was removed (its payload is still there,
        whole, until the slot is reused). Raises TierIOError."""
        if len(slots) == 1:  # (a single block's eviction: no runs to find)
            self._io(os.pwritev, self.hfd, slots[0] * HEADER_BYTES, [ZERO_HEADER])
            return
        for first, idx in _runs(sorted(slots)):
            zeros = bytes(len(idx) * HEADER_BYTES)
            self._io(os.pwritev, self.hfd, first * HEADER_BYTES, [zeros])

    def read_n(self, slots: Sequence[int], sums: Sequence[int | None],
               dsts: Sequence[memoryview]) -> list[bool]:
        """Read payloads into `dsts` (flat writable byte views), each checked against the
        checksum expected of it (the one the tier holds: returned by `write_n`, taken from
        the slot's header at open; None: none is known, a miss); False where they differ
        (another block, damage, an unreadable sector). One preadv per run, no header read:
        the checksum the tier holds is what the header would say. NATIVE: each run in one
        call to _slabio, read and hashed as below. Once the file is closed, all False."""
        if not self._enter():
            return [False] * len(slots)
        try:
            if NATIVE:
                ok = [False] * len(slots)
                piece = CHUNK_BYTES if self.block_bytes >= CHUNKED_BLOCK_BYTES else 0
                for first, idx in _runs(slots):
                    got = _slabio.read_blocks(self.fd, first * self.stride,
                                              [dsts[i] for i in idx], self.stride,
                                              self._run_blocks, piece)
                    for i, c in zip(idx, got):  # (None: unreadable)
                        ok[i] = c is not None and c == sums[i]
                return ok
            if self.block_bytes >= CHUNKED_BLOCK_BYTES:
                return self._read_chunked(slots, sums, dsts)
            return self._read_runs(slots, sums, dsts)
        finally:
            self._leave()

    def _read_runs(self, slots: Sequence[int], sums: Sequence[int | None],
                   dsts: Sequence[memoryview]) -> list[bool]:
        """read_n of small blocks in Python: a preadv per run, its blocks hashed after it."""
        ok = [False] * len(slots)
        for first, idx in _runs(slots, self._run_blocks):
            try:
                self._io(os.preadv, self.fd, first * self.stride,
                         _padded([dsts[i] for i in idx], self._scratch_view))
            except TierIOError:
                if len(idx) == 1 and self._scratch_view is None:
                    continue
                # one bad spot (a sector that will not read, a file cut short) failed the
                # whole run, and its intact neighbours were dropped as damaged with it:
                # each block of the run is read on its own instead, without its pad (a
                # file cut inside the last one's pad has that block whole)
                for i in idx:
                    try:
                        self._io(os.preadv, self.fd, slots[i] * self.stride, [dsts[i]])
                    except TierIOError:
                        continue
                    ok[i] = sums[i] is not None and checksum(dsts[i]) == sums[i]
                continue
            for i in idx:  # verified while the run is in cache
                ok[i] = sums[i] is not None and checksum(dsts[i]) == sums[i]
        return ok

    def _read_chunked(self, slots: Sequence[int], sums: Sequence[int | None],
                      dsts: Sequence[memoryview]) -> list[bool]:
        """read_n of big blocks: each in CHUNK_BYTES pieces, each hashed right after its
        preadv, while it is still in cache. Raw loops of reads hashed, against unhashed
        reads of the same blocks: EPYC VM, 4 MiB blocks, 0.82 in 512 KiB pieces, 0.79 read
        whole and hashed after; Xeon VM (2 MiB L2), 1 and 4 MiB blocks, 0.80-0.81 in
        128 KiB pieces, 0.82 in 256 KiB, 0.77-0.78 in 512 KiB, 0.72-0.75 whole. The tier's
        gets there, 512 KiB pieces (4 MiB only) -> 256 KiB (1 MiB too), of a plain file's:
        1 MiB 0.61 -> 0.67 single, 0.67 -> 0.76 x16; 4 MiB 0.70 -> 0.74, 0.75 -> 0.79."""
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

    def headers(self, slots: Sequence[int], unreadable_as_none: bool = False
                ) -> Iterator[tuple[int, bytes | None, int]]:
        """(slot, block hash, checksum) of the headers found in `slots` (hash None: no valid
        header of this namespace); what recovery checks and rebuilds an index from. The
        header file is read up to HEADER_WINDOW headers at a time (sorted slots: once over).
        A read the disk refuses raises TierIOError: taken for "no header" (as it was), one
        EIO at open had the tier drop every index entry of that window and free its slots.
        With `unreadable_as_none` (a check's report), those slots are no header."""
        window, base, last = b"", 0, max(slots, default=0)
        for slot in slots:
            if not base <= slot < base + len(window) // HEADER_BYTES:
                base, n = slot, min(HEADER_WINDOW, last - slot + 1)
                try:
                    window = os.pread(self.hfd, n * HEADER_BYTES, slot * HEADER_BYTES)
                except OSError as e:
                    if not unreadable_as_none:
                        raise TierIOError(f"the SSD tier's headers at {self.headers_path} "
                                          f"cannot be read: {e}") from e
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
        views = [v for v in (memoryview(b).cast("B") for b in bufs) if len(v)]  # (bytes,
        while views:  # not items: a float16 tensor's view counts two a byte)
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
        """Give back disk beyond `num_slots` (a reopen with less capacity), and beyond the
        slots both files back (one left longer: a crash between their extents, or one
        cut short on disk). The headers go first, so a crash between the two leaves the
        slab file the longer. Left there, old headers past the end were kept by the
        next extent's posix_fallocate (it zeroes nothing already written) and adopted at
        the open after it, naming blocks whose bytes were gone: a put of them answered
        EXISTS and stored nothing."""
        self.num_grown = min(self.num_grown, num_slots)
        for fd, size in ((self.hfd, HEADER_BYTES), (self.fd, self.stride)):
            if os.fstat(fd).st_size > self.num_grown * size:
                os.ftruncate(fd, self.num_grown * size)

    def close(self) -> None:
        """Close both files, once the payload calls in flight have returned (new ones are
        refused from now on)."""
        with self._gate:
            self._closing = True
            while self._busy:
                self._gate.wait()
        if self._dev is not None:
            with _open_lock:
                _open_on[self._dev] -= 1
            self._dev = None
        for name in ("fd", "hfd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


def _open(path: str, flags: int = 0, readonly: bool = False) -> int:
    mode = os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT
    try:
        return os.open(path, mode | os.O_CLOEXEC | flags, 0o600)
    except OSError as e:
        raise TierIOError(f"cannot open the SSD slab file {path}: {e}") from e


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
