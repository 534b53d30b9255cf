"""SSD tier: block payloads in a slab file of fixed slots, a small RocksDB index beside it.

    <path>/slabs.dat    slot i's payload at i * stride        (kvstore.tiers.slabfile; both
    <path>/headers.dat  slot i's 64-byte block header at i * 64  grow by extents as needed)
    <path>/index/       RocksDB: block hash -> (slot, checksum)  (kvstore.tiers.ssdindex)

Each payload byte is written once, straight from the caller's buffer, and read back with
one preadv into the destination, its xxh3_64 checksum checked on every read against the
one the tier holds (written in its slot's header and index entry, taken from the header
at open), so a corrupted or misplaced block is a miss, never wrong KV.

Crash consistency by ordering and verification: a block's payload, then its header, are
written before its index entry is queued (kvstore.tiers.ssdindex writes the queue in groups,
WAL on when `durable`), so an entry never points at bytes that were not written; the headers
are the complete record, and every open adopts the intact headers of slots the index does
not cover, so a put acknowledged before a crash is found whether its entry was written or
not. A freed slot's header is zeroed at once (before the slot can be reused) and its entry's
delete queued in order with the entries that follow it, so neither a stale entry nor the
headers bring a removed block back; anything left stale by a crash fails the header check
at open and is dropped. Survives close/reopen and SIGKILL. A directory of an older layout is
moved aside at open, not read (its blocks are a cache: the tier starts empty beside it).

Failures stay local: a disk with no room to grow turns allocation into None (the store
answers NO_SPACE); a refused index write fails no put (its entries wait in the queue, and the
headers hold them) and the index reopens or rebuilds itself; a damaged index found at open is
set aside and rebuilt from the slab headers; deleting never raises (a stale entry is
harmless, see above).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Sequence

import numpy as np

from kvstore.buffers import cpu_array
from kvstore.errors import StoreClosedError, TierIOError
from kvstore.events import TierKind
from kvstore.keys import Namespace
from kvstore.tiers.base import ByteBatch, FreeSlots
from kvstore.tiers.slabfile import SlabFile, old_layout
from kvstore.tiers.ssdindex import SlotIndex, parse_entry
from transfer.copy import copy_bytes

log = logging.getLogger("kvtier.ssd")
TIER_FILE = "tier.json"  # the namespace whose blocks the directory holds (for `kvtier fsck`)
GROW_RETRY_S = 2.0  # after the disk refused an extent, try again this much later


class SsdTier:
    kind = TierKind.SSD
    persistent = True

    def __init__(self, ns: Namespace, path: str, num_slots: int, durable: bool = True) -> None:
        _set_aside_old_layout(path, ns)
        os.makedirs(path, exist_ok=True)
        _write_tier_file(path, ns)
        self.ns, self.path, self.durable = ns, path, durable
        self.num_slots, self.slot_bytes = num_slots, ns.block_bytes
        self.slabs = SlabFile(path, ns, num_slots)
        self.index = SlotIndex(os.path.join(path, "index"), durable, self._table)
        had_index = os.path.isfile(os.path.join(self.index.path, "CURRENT"))
        try:
            self._at_open = self.index.open()  # entries as found; `recover` checks them
            if self.slabs.headers_missing:
                if self.index.db is None:  # (not opened: a full disk) its entries are unknown,
                    # and headers written from none would say every slot is free
                    raise TierIOError(f"the SSD tier at {self.path} lost its header file and "
                                      "its index cannot open now (no disk space) to write "
                                      "it again; the next open with room does")
                self._restore_headers()
        except BaseException:
            self.slabs.close()
            raise
        if not had_index and self.slabs.num_grown:  # slabs written, the index gone (deleted,
            self.index.damaged = True  # never synced): rebuilt from the headers, as if damaged
        self._held: dict[bytes, tuple[int, int]] = {}  # hash -> (slot, checksum): the truth
        # slot -> (hash, checksum) of a block written while its hash was held in another
        # slot: two puts of one hash may each be writing a slot (kvstore.tiermap.claim).
        # Whichever commits first (publish_n) holds the hash; the other's slot is freed
        # without touching the hash's entry.
        self._twins: dict[int, tuple[bytes, int]] = {}
        # `_held` and `_twins` change together under it: write_n runs outside the store's
        # lock, and two of one hash at once both found it free and both took it
        self._held_lock = threading.Lock()
        self._free = FreeSlots(0)
        self._grow_failed_at: float | None = None
        self._closed = False
        self.num_dropped_at_open = 0
        self.num_recovered_from_slabs = 0
        _warn_if_bigger_than_disk(path, num_slots * self.slabs.slot_disk_bytes)

    def _restore_headers(self) -> None:
        """headers.dat is gone while slabs.dat holds payloads: written again from the index
        (the blocks stay; each is checked against its checksum on every read)."""
        entries = [e for e in (parse_entry(k, v) for k, v in self._at_open) if e is not None]
        try:
            n = self.slabs.restore_headers(entries)
        except (OSError, TierIOError) as e:  # headers.dat still missing: the next open
            raise TierIOError(f"the SSD tier at {self.path} lost its header file and cannot "
                              f"write it again now ({e}); the next open tries again") from e
        log.warning("SSD tier %s: headers.dat was missing; %d block headers written again "
                    "from the index", self.path, n)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"SSD tier at {self.path} is closed")

    # ------------------------------------------------------------- slots

    def num_free(self) -> int:
        growable = self.num_slots - self.slabs.num_grown
        if self._grow_failed_at is not None and time.monotonic() - self._grow_failed_at < GROW_RETRY_S:
            growable = 0
        return len(self._free) + growable

    def num_used(self) -> int:
        return self.slabs.num_grown - len(self._free)

    def alloc_n(self, n: int) -> list[int] | None:
        self._check_open()
        while len(self._free) < n:
            if self.num_free() < n:
                return None
            try:
                grown = self.slabs.grow(n - len(self._free))
            except TierIOError as e:
                self._grow_failed_at = time.monotonic()
                log.warning("%s", e)
                return None
            if not grown:  # at capacity after all: nothing more will come of asking
                return None
            self._grow_failed_at = None
            self._free.give_back(list(reversed(grown)))
        return self._free.take(n)

    def free_n(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        gone = []  # the hashes held in these very slots
        with self._held_lock:
            for slot, h in zip(slots, hashes):
                h = bytes(h)
                if self._twins.pop(slot, None) is None and self._held.get(h, (-1,))[0] == slot:
                    del self._held[h]
                    gone.append(h)
        self.index.forget_n(gone)  # deleted with the next index write (see ssdindex)
        try:  # before the slots can be reused (under the store lock): no new header is hit
            self.slabs.erase_headers(slots)
        except TierIOError as e:  # only an index rebuilt from these headers could bring the
            log.warning("%s", e)  # blocks back; the free itself stands
        self._free.give_back(slots)

    def persist_frees(self) -> None:
        if not self._closed and self.index.num_queued:  # the queued deletes and entries
            self.index.write_queued()  # written now (WAL: they survive a kill)

    def publish_n(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Readers on this host reach SSD blocks through the daemon only: nothing to show
        them. A twin (see `_twins`) that commits first takes its hash over (its index entry
        queued: written outside the store's lock, see ssdindex)."""
        if not self._twins:
            return
        with self._held_lock:
            won = [(slot, self._twins.pop(slot)) for slot in slots if slot in self._twins]
            for slot, (h, c) in won:
                self._held[h] = (slot, c)
        if won:
            self.index.queue_n([h for _, (h, _) in won], [s for s, _ in won],
                               [c for _, (_, c) in won])

    # ------------------------------------------------------------- bytes

    def write_n(self, slots: Sequence[int], hashes: Sequence[bytes], srcs: ByteBatch) -> None:
        self._check_open()
        sums = self.slabs.write_n(slots, hashes, _host_views(srcs, self.slot_bytes))
        mine = []  # (the hashes not held in another slot: see _twins)
        with self._held_lock:
            for h, slot, c in zip(map(bytes, hashes), slots, sums):
                held = self._held.get(h)
                if held is None or held[0] == slot:
                    self._held[h] = (slot, c)
                    mine.append((h, slot, c))
                else:
                    self._twins[slot] = (h, c)
            if mine:  # queued, after the bytes and headers: never an entry without them
                self.index.queue_n(*zip(*mine))  # (the headers alone bring it back at open)
        self.index.write_if_due()  # (here, outside both locks)

    def read_n(self, slots: Sequence[int], hashes: Sequence[bytes], dsts: ByteBatch) -> list[bool]:
        """Straight into host destinations (one preadv per run of slots); device ones
        through a host buffer."""
        self._check_open()
        sums = self._sums(slots, hashes)
        if cpu_array(dsts) is not None:  # one [n, bytes] host array
            return self.slabs.read_n(slots, sums, _host_views(dsts, self.slot_bytes))
        rows = [cpu_array(d) for d in dsts]
        on_host = [r is not None for r in rows]
        views = [memoryview(r) if r is not None else memoryview(np.empty(self.slot_bytes, np.uint8))
                 for r in rows]
        ok = self.slabs.read_n(slots, sums, views)
        for d, v, host, good in zip(dsts, views, on_host, ok):
            if good and not host:
                copy_bytes(d, np.frombuffer(v, np.uint8))
        return ok

    def _sums(self, slots: Sequence[int], hashes: Sequence[bytes]) -> list[int | None]:
        """The checksum each slot's payload must have (None where the tier does not hold
        that block in that slot)."""
        out = []
        for slot, h in zip(slots, hashes):
            h = bytes(h)
            held = self._held.get(h)
            if held is None or held[0] != slot:
                twin = self._twins.get(slot)
                held = (slot, twin[1]) if twin is not None and twin[0] == h else None
            out.append(held[1] if held is not None else None)
        return out

    # ------------------------------------------------------------- open

    def recover(self) -> list[tuple[bytes, int]]:
        """Every intact block found at open, with its slot (and the index made to agree):
        the index's entries whose slots hold their headers, and the headers of every other
        slot (the blocks whose entries were still queued when the process died, or all of
        them when the index was lost)."""
        self._check_open()
        raw, self._at_open = self._at_open, []
        found, dropped = self._verified(raw)
        adopted = self._adopt_from_slabs(found)
        found.update(adopted)
        self._held.update(found)
        # a stale entry of a block adopted from another slot: overwritten by the adopted
        # entry, not deleted (its delete, queued after, deleted the fresh entry too)
        dropped = [h for h in dropped if bytes(h) not in found]
        try:
            if self.index.damaged and self._held:  # the fresh index gets what the slabs showed
                hashes, slots, sums = zip(*self._table())
                self.index.put_n(hashes, slots, sums)
            elif adopted:
                self.index.put_n(list(adopted), *zip(*adopted.values()))
            self.index.delete_n(dropped)  # with the entries queued above, in one write
        except TierIOError as e:
            log.warning("%s", e)
        self.num_dropped_at_open = len(dropped)
        self.slabs.truncate_to(self.num_slots)
        used = {slot for slot, _ in found.values()}
        self._free.give_back([s for s in reversed(range(self.slabs.num_grown)) if s not in used])
        return [(h, slot) for h, (slot, _) in found.items()]

    def _verified(self, raw: list[tuple[bytes, bytes]]
                  ) -> tuple[dict[bytes, tuple[int, int]], list[bytes]]:
        """Index entries whose slot exists and holds that block's header (of two entries
        naming one slot, a delete a crash cut off left one stale: the header decides). A
        header that names a block a few bits off the entry's, with the entry's checksum,
        was damaged (its hash field: adopted as it was, the payload answered for a key
        nobody put): the entry stands, and the header is written again. (Two real hashes
        are ~64 bits apart: a header naming one of those is another block, maybe of the
        same bytes, put after the entry's was freed; it is adopted as ever.)"""
        by_slot: dict[int, list[tuple[bytes, int]]] = {}
        dropped = []
        for key, value in raw:
            entry = parse_entry(key, value)
            if entry is None or entry[1] >= min(self.num_slots, self.slabs.num_grown):
                dropped.append(key)
                continue
            by_slot.setdefault(entry[1], []).append((entry[0], entry[2]))
        on_disk = {slot: (h, c) for slot, h, c in self.slabs.headers(sorted(by_slot))}
        found: dict[bytes, tuple[int, int]] = {}
        mended = []
        for slot, named in by_slot.items():
            header_hash, c = on_disk.get(slot, (None, 0))
            if header_hash not in {h for h, _ in named}:
                vouched = ([h for h, ec in named if ec == c and damaged_copy(h, header_hash)]
                           if header_hash is not None else [])
                if len(vouched) == 1:
                    header_hash = vouched[0]
                    mended.append((slot, header_hash, c))
            for h, ec in named:
                if h != header_hash:
                    dropped.append(h)
                elif ec != c and self._payload_sums_to(slot, ec):  # the header's checksum
                    found[h] = (slot, ec)  # field was damaged (the payload is the index's):
                    mended.append((slot, h, ec))  # written again, the block kept
                else:  # with the header's checksum: the one written with these bytes
                    found[h] = (slot, c)
        if mended:
            log.warning("SSD tier %s: %d block headers disagreed with the index where the "
                        "index is right (damaged): written again", self.path, len(mended))
            try:
                self.slabs.write_headers(mended)
            except TierIOError as e:
                log.warning("%s", e)
        return found, dropped

    def _payload_sums_to(self, slot: int, c: int) -> bool:
        """Whether `slot`'s payload reads back with checksum `c` (at open, for an entry and
        a header of one block that disagree on it: the header's field damaged made an
        intact block a miss)."""
        buf = memoryview(np.empty(self.slot_bytes, np.uint8))
        return self.slabs.read_n([slot], [c], [buf])[0]

    def _adopt_from_slabs(self, found: dict[bytes, tuple[int, int]]
                          ) -> dict[bytes, tuple[int, int]]:
        """Blocks whose headers sit in slots the index did not cover (their entries never
        written: queued when the process died, or the index lost). A second header of a
        block already found is zeroed: left, it would bring the block back at a later open
        after the copy found was removed."""
        used = {slot for slot, _ in found.values()}
        adopted: dict[bytes, tuple[int, int]] = {}
        twins = []
        free = [s for s in range(min(self.num_slots, self.slabs.num_grown)) if s not in used]
        for slot, h, c in self.slabs.headers(free):
            if h is None:
                continue
            if h in found or h in adopted:
                twins.append(slot)
            else:
                adopted[h] = (slot, c)
        if twins:
            try:
                self.slabs.erase_headers(twins)
            except TierIOError as e:
                log.warning("%s", e)
        self.num_recovered_from_slabs = len(adopted)
        if adopted:
            (log.warning if self.index.damaged else log.info)(
                "SSD tier %s: %d blocks recovered from the slab headers", self.path, len(adopted))
        return adopted

    def _table(self):
        return [(h, slot, c) for h, (slot, c) in list(self._held.items())]

    def slot_view(self, slot: int) -> np.ndarray:
        """A copy of the block in `slot` (read and verified: an SSD slot has no in-memory
        view; the store never demotes from its last tier)."""
        self._check_open()
        ((_, block_hash, c),) = self.slabs.headers([slot])
        out = np.empty(self.slot_bytes, np.uint8)
        if block_hash is None or not self.slabs.read_n([slot], [c], [memoryview(out)])[0]:
            raise TierIOError(f"SSD slot {slot} of {self.path} holds no intact block")
        return out

    def locate(self, block_hash: bytes) -> tuple[str, int] | None:
        """Where a stored block's payload lies on disk: (slab file, byte offset), or None."""
        held = self._held.get(bytes(block_hash))
        return None if held is None else (self.slabs.path, held[0] * self.slabs.stride)

    def raw_db(self):
        """The underlying RocksDB index (for tools and fault-injection tests)."""
        return self.index.db

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.index.close()
        self.slabs.close()


DAMAGED_BITS = 8  # a header hash this close to an entry's is that hash damaged (two hashes
# of real blocks are this close with odds of about 2^-80)


def damaged_copy(h: bytes, other: bytes) -> bool:
    """Whether `other` reads as `h` with a few bits flipped (DAMAGED_BITS at most)."""
    return 0 < (int.from_bytes(h, "little") ^ int.from_bytes(other, "little")).bit_count() <= DAMAGED_BITS


def _host_views(srcs: ByteBatch, nbytes: int) -> list[memoryview]:
    """Flat byte views of a batch's rows: a host `[n, nbytes]` array is viewed once and
    sliced (a torch row and its .numpy() cost ~3 us each); device rows are copied to host."""
    whole = cpu_array(srcs)
    if whole is not None:
        flat = memoryview(whole).cast("B")
        return [flat[i:i + nbytes] for i in range(0, len(flat), nbytes)]
    return [memoryview(row if (row := cpu_array(src)) is not None else src.cpu().numpy()).cast("B")
            for src in srcs]


def _warn_if_bigger_than_disk(path: str, nbytes: int) -> None:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        log.warning("the SSD tier at %s may grow to %d MiB but its disk has %d MiB free: "
                    "once the disk is full, puts that need SSD are answered NO_SPACE",
                    path, nbytes >> 20, free >> 20)


def _write_tier_file(path: str, ns: Namespace) -> None:
    """Name the namespace the directory holds now (rewritten when it differs: fsck must
    check the blocks against the namespace that wrote them). A directory reopened for
    another namespace serves none of the first's blocks (their headers name the first);
    reopened for the first again, those in slots the second did not reuse come back,
    checked as ever."""
    meta = os.path.join(path, TIER_FILE)
    text = json.dumps(dataclasses.asdict(ns))
    try:
        with open(meta) as f:
            if f.read() == text:
                return
    except (OSError, UnicodeDecodeError):
        pass  # absent or unreadable: written afresh
    with open(meta + ".tmp", "w") as f:
        f.write(text)
    os.replace(meta + ".tmp", meta)


def _set_aside_old_layout(path: str, ns: Namespace) -> None:
    """A directory of an older layout is moved aside, not read: its blocks are a cache, and
    the new tier starts empty beside it. Layouts: one RocksDB value per block (a RocksDB
    `CURRENT` at the top), then a slab file whose slots held each block's header."""
    if os.path.isfile(os.path.join(path, "CURRENT")):
        layout = "one-value-per-block"
    elif old_layout(path, ns):
        layout = "header-in-slot slab"
    else:
        return
    aside = f"{path}.legacy-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(path, aside)
    log.warning("SSD tier %s was in the old %s layout: moved to %s (remove it once "
                "unneeded); starting empty", path, layout, aside)
