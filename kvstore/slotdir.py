"""The DRAM arena's slot directory: lets a same-host reader copy a block with no round trip.

A small anonymous shared-memory segment beside the arena, written only by the store's
process (under the store lock) and mapped read-only by clients it was handed to (a sealed
memfd: no process can map it writable, see `transfer.shm`):

    header (64 B)   magic "KVTDIR01" | num_slots u64 | table_size u64 | closed u64
    gen[num_slots]  int64 per slot, a sequence lock: even = holds a readable block,
                    odd = free, reserved or being written
    owner[num_slots] 16 B per slot: the block hash the slot holds while gen is even
    table[table_size] int64: tag << 32 | slot + 1 of a published block, bucketed by its
                    hash (0 empty); the tag is 31 more bits of that hash, so a reader
                    checks the slot of an entry whose tag matches only

The store publishes a block when it becomes readable in a slot (`owner` first, then gen
odd -> even) and unpublishes it before the slot can be reused (gen even -> odd, then the
table entry is cleared). A reader finds a candidate slot in the table, checks gen is even
and owner is its hash, copies the slot, and re-reads gen: unchanged means no byte it copied
belonged to another block. The table is only a hint: a stale, torn or overwritten entry
fails those checks and the reader asks the daemon instead, so correctness rests on gen and
owner alone.

Liveness: the store's process holds an exclusive flock on the memfd for its whole life,
and the kernel drops it when that process dies, even by SIGKILL. Readers get their own open
file description of it (never the owner's, which would share the lock and keep it alive),
and check the lock (one non-blocking flock call) before each batch, so a dead daemon's
arena, still mapped and still holding valid-looking blocks, serves nothing.

Ordering: the writer's stores and the reader's loads stay in program order on x86-64 (TSO),
which the protocol relies on; `DIRECT_READS` is False on other CPUs and the clients there
keep the leased round-trip path.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import platform
import struct
import time
from typing import Sequence

import numpy as np

from kvstore.errors import ConfigError
from transfer.shm import ShmSegment

try:  # the per-block loops below in C (kvstore/_slotdir.c), where it was built
    import kvstore._slotdir as _slotdir
except ImportError:
    _slotdir = None

MAGIC = b"KVTDIR02"  # (01: untagged table entries)
HEADER = struct.Struct("<8sQQQ")
HEADER_BYTES = 64
PROBES = 8  # a block's table entry lives in one of the 8 buckets after its hash's bucket
SLOT_BITS = 32  # a table entry's low bits: slot + 1; above them, the hash's tag
LOW = (1 << SLOT_BITS) - 1
HIGH = ~LOW
TAG_BITS = 31  # (entries stay non-negative int64s)
MAX_SLOTS = LOW - 1
ALIVE_CHECK_S = 0.02
DIRECT_READS = platform.machine().lower() in ("x86_64", "amd64")


def _layout(num_slots: int) -> tuple[int, int, int, int]:
    """(table_size, gen offset, owner offset, table offset); total bytes = table end."""
    table_size = 1 << max(4, (2 * num_slots - 1).bit_length())  # load factor <= 0.5
    gen_off = HEADER_BYTES
    owner_off = gen_off + 8 * num_slots
    table_off = owner_off + 16 * num_slots
    return table_size, gen_off, owner_off, table_off


_KEY = struct.Struct("<QI").unpack_from  # a hash's bucket bits (first 8 bytes), tag bits
_PROBE = struct.Struct(f"<{PROBES}q").unpack_from  # the PROBES entries from a bucket on
_TAG_MASK = (1 << TAG_BITS) - 1


def _key(block_hash: bytes, mask: int) -> tuple[int, int]:
    """(bucket, tag << SLOT_BITS) of a hash: its first 8 bytes (little-endian) masked, and
    TAG_BITS of the next 4."""
    b, t = _KEY(block_hash)
    return b & mask, (t & _TAG_MASK) << SLOT_BITS


def entry(slot: int, block_hash: bytes) -> int:
    """The table entry of `block_hash` held in `slot`."""
    return _key(block_hash, 0)[1] | (slot + 1)


class _Views:
    """Typed views over one mapping of a directory file."""

    def __init__(self, mm: mmap.mmap, num_slots: int) -> None:
        self.mm, self.num_slots = mm, num_slots
        self.table_size, gen_off, owner_off, table_off = _layout(num_slots)
        self.mask = self.table_size - 1
        raw = memoryview(mm)
        self.raw = raw
        self.gen = raw[gen_off:owner_off].cast("q")
        self.owner = raw[owner_off:table_off]
        self.owner_off, self.table_off = owner_off, table_off
        self.table = raw[table_off:table_off + 8 * self.table_size].cast("q")

    def release(self) -> None:
        for v in (self.gen, self.owner, self.table, self.raw):
            v.release()


class SlotDirectory:
    """The writer side, owned by a DRAM tier. Every method runs under the store's lock."""

    def __init__(self, num_slots: int) -> None:
        if num_slots > MAX_SLOTS:
            raise ConfigError(f"a DRAM tier of {num_slots} slots is more than a slot "
                              f"directory indexes ({MAX_SLOTS}): use bigger blocks")
        table_size, *_, table_off = _layout(num_slots)
        self._seg = ShmSegment.anonymous(table_off + 8 * table_size, "kvtier-slotdir",
                                         final=False)
        fcntl.flock(self._seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until we close or die
        self._seg.seal_writes()  # readers are handed read-only descriptors: none can write
        self._mm = self._seg._mm
        self._v = _Views(self._mm, num_slots)
        gen = np.frombuffer(self._mm, np.int64, num_slots, HEADER_BYTES)
        gen[:] = 1  # every slot starts free (odd)
        HEADER.pack_into(self._mm, 0, MAGIC, num_slots, table_size, 0)

    def share_fd(self) -> int:
        """A read-only descriptor of the directory for a reader (send it, then close it)."""
        return self._seg.share_fd(writable=False)

    def publish(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        """The blocks are now readable in these slots (and will not change until unpublished)."""
        v = self._v
        if _slotdir is not None:
            _slotdir.publish(v.gen, v.owner, v.table, slots, hashes)
            return
        gen, owner, table, mask = v.gen, v.owner, v.table, v.mask
        for slot, h in zip(slots, hashes):
            if not gen[slot] & 1:
                continue  # already published
            owner[16 * slot:16 * slot + 16] = h
            gen[slot] += 1  # odd -> even: after the owner, so a reader never sees it stale
            b, tag = _key(h, mask)
            for k in range(PROBES):
                i = (b + k) & mask
                cur = (table[i] & LOW) - 1
                if cur < 0 or gen[cur] & 1:
                    table[i] = tag | (slot + 1)
                    break
            else:
                table[b] = tag | (slot + 1)  # a crowded bucket: that other block loses its hint

    def unpublish(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        """The blocks leave these slots: no reader may use them from now on."""
        v = self._v
        if _slotdir is not None:
            _slotdir.unpublish(v.gen, v.owner, v.table, slots, hashes)
            return
        gen, table, mask = v.gen, v.table, v.mask
        for slot, h in zip(slots, hashes):
            if gen[slot] & 1:
                continue  # never published (a reservation given back)
            gen[slot] += 1  # even -> odd first: a copy in flight now fails its re-check
            b, _ = _key(h, mask)
            for k in range(PROBES):
                i = (b + k) & mask
                if table[i] & LOW == slot + 1:
                    table[i] = 0
                    break

    def close(self) -> None:
        """Tell readers the store is gone (they fall back to asking the daemon)."""
        if self._seg.fd is None:
            return
        HEADER.pack_into(self._mm, 0, MAGIC, self._v.num_slots, self._v.table_size, 1)
        self._v.release()
        self._seg.close()  # drops our flock too


class SlotDirectoryReader:
    """The reader side: maps a directory read-only and validates direct copies."""

    def __init__(self, fd: int, num_slots: int) -> None:
        """`fd`: a read-only descriptor of the directory (`SlotDirectory.share_fd`); the
        reader keeps it (for the liveness check) and closes it once let go (`close`)."""
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._dead, self._alive_at = fd, False, -1.0
        magic, n, table_size, _ = HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC or n != num_slots or size < _layout(n)[3] + 8 * table_size:
            self._mm.close()
            self._fd = -1
            os.close(fd)
            raise ConfigError(f"not the slot directory of a {num_slots}-slot arena")
        self._v = _Views(self._mm, num_slots)
        _, gen_off, owner_off, table_off = _layout(num_slots)  # numpy views for batches
        self._gen = np.frombuffer(self._mm, np.int64, num_slots, gen_off)
        self._owner = np.frombuffer(self._mm, np.uint8, 16 * num_slots, owner_off).reshape(-1, 16)
        self._table = np.frombuffer(self._mm, np.int64, table_size, table_off)

    def writer_alive(self) -> bool:
        """False once the store's process has closed the directory or died (its flock is
        gone); then nothing here may be read any more. The lock is probed at most every
        ALIVE_CHECK_S (a syscall per read cost ~5 us): a copy made meanwhile from a dead
        writer's arena is still the right block (its generation check holds), never another."""
        if self._dead:
            return False
        now = time.monotonic()
        if now - self._alive_at < ALIVE_CHECK_S:
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            self._alive_at = now
            return True  # the writer holds its exclusive lock: alive
        except OSError:  # (closed meanwhile: see close)
            self._dead = True
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._dead = True
        return False

    @property
    def closed(self) -> bool:
        return bool(self._v.raw[24])

    def find(self, block_hash: bytes) -> tuple[int, int] | None:
        """(slot, gen) of a published block holding `block_hash`, or None (ask the daemon).
        Copy the slot, then `still_valid(slot, gen)` says whether the copy is that block."""
        v = self._v
        mm = v.mm
        if mm[24] or len(block_hash) != 16:
            return None  # closed, or no block's hash (the daemon's request says what is wrong)
        if _slotdir is not None and type(block_hash) is bytes:
            return _slotdir.find(v.gen, v.owner, v.table, block_hash)
        b, tag = _KEY(block_hash)  # _key inlined (a find is ~1 us; a call is a tenth)
        tag, b = (tag & _TAG_MASK) << SLOT_BITS, b & v.mask
        # the PROBES entries at once where they do not wrap: only those with the hash's tag
        # are looked into (untagged, a put's miss checked the owner of every block in its
        # probes, ~4 at the table's load: 7 us of a ~50 us same-host 256 KiB put)
        entries = (_PROBE(mm, v.table_off + 8 * b) if b + PROBES <= v.table_size else
                   [v.table[(b + k) & v.mask] for k in range(PROBES)])
        for e in entries:
            if e & HIGH == tag:
                slot = (e & LOW) - 1
                if 0 <= slot < v.num_slots:
                    g = v.gen[slot]
                    at = v.owner_off + 16 * slot
                    # the mmap's slice is bytes: compared ~1.5x faster than a memoryview's
                    if not g & 1 and mm[at:at + 16] == block_hash:
                        return slot, g
        return None

    def still_valid(self, slot: int, gen: int) -> bool:
        v = self._v
        return v.gen[slot] == gen and not v.raw[24]

    def find_n(self, packed: bytes) -> tuple[np.ndarray, np.ndarray]:
        """`find` for many hashes at once (n x 16 packed bytes) in a few numpy passes:
        (slots, gens), slot -1 where not found. Gens are read before owners, as in `find`."""
        n = len(packed) // 16
        slots, gens = np.full(n, -1, np.int64), np.zeros(n, np.int64)
        if self._v.raw[24] or not n:
            return slots, gens
        keys = np.frombuffer(packed, np.uint8).reshape(n, 16)
        mask = self._v.mask
        buckets = (np.frombuffer(packed, "<u8")[0::2] & np.uint64(mask)).astype(np.int64)
        tags = (np.frombuffer(packed, "<u4")[2::4] & _TAG_MASK).astype(np.int64) << SLOT_BITS
        todo = np.arange(n)
        for k in range(PROBES):
            e = self._table[(buckets[todo] + k) & mask]
            cand = (e & LOW) - 1
            ok = (e & HIGH == tags[todo]) & (cand >= 0) & (cand < self._v.num_slots)
            cand = np.where(ok, cand, 0)
            g = self._gen[cand]
            hit = ok & ((g & 1) == 0) & (self._owner[cand] == keys[todo]).all(axis=1)
            slots[todo[hit]], gens[todo[hit]] = cand[hit], g[hit]
            todo = todo[~hit]
            if not todo.size:
                break
        return slots, gens

    def still_valid_n(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Per slot: did its generation stay put (and the store stay open)?"""
        if self._v.raw[24]:
            return np.zeros(len(slots), bool)
        return self._gen[slots] == gens

    def close(self) -> None:
        """Unmapped now; its descriptor is closed when the last reference goes (`__del__`):
        a thread inside `writer_alive` (a client closed from another thread) flocked a
        number closed under it (EBADF), or one reused for another file meanwhile."""
        if self._mm.closed:
            return
        self._dead = True
        self._v.release()
        self._gen = self._owner = self._table = None
        try:
            self._mm.close()
        except BufferError:
            pass

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            try:
                os.close(fd)
            except (OSError, TypeError):  # (at interpreter exit)
                pass

