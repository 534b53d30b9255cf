"""The SSD tier's payload file: fixed-size slots in one file that grows by extents.

Slot i lives at byte `i * stride`:

    payload (block_bytes) | block header (64 B, kvstore.layout: hash, namespace, checksum) | pad

with `stride` the payload plus header rounded up to 4 KiB, so every slot starts on a page.
Each byte of a block is written once (`pwritev` of payload + header, batched over runs of
consecutive slots) and read back with one `preadv` straight into the caller's buffer. The
header makes every slot self-describing: a read checks the hash and the checksum, and the
tier's index can always be rebuilt from the file alone.

The file grows on demand in extents of `extent_slots` slots, each reserved with
`posix_fallocate` before a slot in it is handed out: a full disk shows up as "no room to
grow" (a clean NO_SPACE for the put), never as a write that fails halfway.
"""
from __future__ import annotations

import errno
import os
from typing import Iterator, Sequence

from kvstore.errors import BlockFormatError, TierIOError
from kvstore.keys import Namespace
from kvstore.layout import HEADER_BYTES, checksum, decode_header, encode_header

PAGE = 4096
EXTENT_BYTES = 256 << 20
INDEX_HEADROOM = 1 << 20  # disk the slab file never takes: the index must still write
IOV_BLOCKS = 300  # blocks per preadv/pwritev (3 iovecs each, under IOV_MAX = 1024)
HASHED_RUN_BYTES = 2 << 20  # reads and writes go in runs of about a cache's worth, each run
# hashed right next to its I/O (see write_n)


def stride_of(block_bytes: int) -> int:
    return -(-(block_bytes + HEADER_BYTES) // PAGE) * PAGE


class SlabFile:
    def __init__(self, path: str, ns: Namespace, num_slots: int) -> None:
        self.path, self.ns, self.num_slots = path, ns, num_slots
        self.block_bytes = ns.block_bytes
        self.stride = stride_of(self.block_bytes)
        self.extent_slots = max(1, EXTENT_BYTES // self.stride)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise TierIOError(f"cannot open the SSD slab file {path}: {e}") from e
        size = os.fstat(self.fd).st_size
        self.num_grown = min(num_slots, size // self.stride)  # slots backed by the file
        pad = self.stride - self.block_bytes - HEADER_BYTES
        self._pad_view = memoryview(bytes(pad))
        self._scratch_view = memoryview(bytearray(pad))
        self._run_blocks = max(1, HASHED_RUN_BYTES // self.block_bytes)

    def grow(self, min_slots: int = 1) -> range:
        """Reserve the next extent on disk (smaller ones, down to `min_slots`, when the
        disk has less room); the new slots, or an empty range at capacity. Raises
        TierIOError when not even `min_slots` fit."""
        start = self.num_grown
        n = min(self.num_slots, start + max(self.extent_slots, min_slots)) - start
        st = os.statvfs(self.path)
        n = min(n, max(0, st.f_bavail * st.f_frsize - INDEX_HEADROOM) // self.stride)
        error = None if n else OSError(errno.ENOSPC, "no room left beside the index's "
                                       f"{INDEX_HEADROOM >> 10} KiB")
        while n >= min(min_slots, self.num_slots - start) and n > 0:
            try:
                os.posix_fallocate(self.fd, start * self.stride, n * self.stride)
            except OSError as e:
                error, n = e, n // 2
                continue
            self.num_grown = start + n
            return range(start, start + n)
        if error is None:
            return range(0)
        raise TierIOError(f"the SSD tier cannot grow {self.path} by {min_slots} slots "
                          f"({min_slots * self.stride >> 10} KiB): {error}") from error

    def write_n(self, slots: Sequence[int], hashes: Sequence[bytes],
                payloads: Sequence[memoryview]) -> list[int]:
        """Write blocks (flat byte views) with their headers; returns each payload's
        checksum. Each pwritev is of at most HASHED_RUN_BYTES (one block at least), hashed
        just before it: the bytes are still in cache when the kernel copies them (16 x 4 MiB
        hashed first and written after: ~45 us more per block, measured)."""
        sums = [0] * len(payloads)
        pad = self._pad_view
        for first, idx in _runs(slots, self._run_blocks):
            bufs = []
            for i in idx:
                sums[i] = checksum(payloads[i])
                bufs += [payloads[i], encode_header(self.ns, hashes[i], sums[i]), pad]
            self._io(os.pwritev, first, bufs)
        return sums

    def read_n(self, slots: Sequence[int], hashes: Sequence[bytes],
               dsts: Sequence[memoryview]) -> list[bool]:
        """Read blocks into `dsts` (flat writable byte views); False where the slot does not
        hold that block intact (another hash, a bad header, a checksum mismatch, an
        unreadable sector)."""
        ok = [False] * len(slots)
        pad = self._scratch_view
        for first, idx in _runs(slots, self._run_blocks):
            headers = [bytearray(HEADER_BYTES) for _ in idx]
            bufs = []
            for i, header in zip(idx, headers):
                bufs += [dsts[i], header, pad]
            try:
                self._io(os.preadv, first, bufs)
            except TierIOError:
                continue
            for i, header in zip(idx, headers):  # verified while the run is in cache
                ok[i] = self._intact(header, bytes(hashes[i]), dsts[i])
        return ok

    def _intact(self, header: bytes, block_hash: bytes, payload: memoryview) -> bool:
        try:
            hdr = decode_header(header)
        except BlockFormatError:
            return False
        return (hdr.block_hash == block_hash and hdr.ns_id == self.ns.ns_id
                and hdr.shape == self.ns.block_shape
                and checksum(payload) == hdr.checksum)

    def headers(self, slots: Sequence[int]) -> Iterator[tuple[int, bytes | None, int]]:
        """(slot, block hash, checksum) of the headers found in `slots` (hash None: no valid
        header of this namespace); what recovery checks and rebuilds an index from."""
        buf = bytearray(HEADER_BYTES)
        for slot in slots:
            try:
                n = os.preadv(self.fd, [buf], slot * self.stride + self.block_bytes)
                hdr = decode_header(buf) if n == HEADER_BYTES else None
            except (OSError, BlockFormatError):
                hdr = None
            good = (hdr is not None and hdr.ns_id == self.ns.ns_id
                    and hdr.shape == self.ns.block_shape)
            yield slot, (hdr.block_hash if good else None), (hdr.checksum if good else 0)

    def _io(self, fn, first: int, bufs: list) -> None:
        """One pwritev/preadv of `bufs` at slot `first`, continued until every byte moved."""
        offset = first * self.stride
        views = [v if isinstance(v, memoryview) else memoryview(v) for v in bufs if len(v)]
        while views:
            try:
                n = fn(self.fd, views[:1024], offset)
            except OSError as e:
                raise TierIOError(f"SSD tier I/O on {self.path} failed: {e}") from e
            if n == 0:
                raise TierIOError(f"SSD tier I/O on {self.path} hit the end of the file")
            offset += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]

    def truncate_to(self, num_slots: int) -> None:
        """Give back disk beyond `num_slots` (a reopen with less capacity)."""
        if os.fstat(self.fd).st_size > num_slots * self.stride:
            os.ftruncate(self.fd, num_slots * self.stride)
            self.num_grown = min(self.num_grown, num_slots)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
