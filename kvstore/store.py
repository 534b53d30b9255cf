"""TieredStore: one namespace's blocks over an ordered list of tiers (fastest first).

Lifecycle of a block: reserved (slot taken, invisible) -> committed (readable) -> demoted
down the tiers by LRU eviction -> dropped from the last tier. Every block lives in exactly
one slot of one tier. Metadata changes happen under one lock; the bulk copies of user reads
and writes happen outside it, protected by reservations (writers) and reader counts (leases).

Eviction is LRU over evictable blocks (committed, no readers, no hard pin, no live soft pin).
A batch of blocks is touched tail-first, so the tail of a prefix chain is older than its
parents and leaves first. Evicting from a tier demotes to the next tier (write-back);
evicting from the last tier drops. A hit in a lower tier is promoted when configured.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from typing import NamedTuple, Sequence

from kvstore.api import MatchResult, PutStatus, leading_hits  # noqa: F401 - re-exported
from kvstore.buffers import byte_rows, select_rows
from kvstore.config import StoreConfig, TierConfig
from kvstore.errors import ReservationError, StoreClosedError, TierIOError
from kvstore.events import EventKind, KVEvent, TierKind
from kvstore.keys import Namespace, check_hashes, hash_keys
from kvstore.layout import decode_block
from kvstore.tiermap import Entry, Move, TierMap, State, group_by_tier, visible
from kvstore.grants import Grants
from kvstore.reads import NO_SLOT, Lease, Reads  # noqa: F401 - re-exported
from kvstore.stats import StoreStats
from kvstore.tiers.base import Tier
from kvstore.tuning import background_thread

log = logging.getLogger("kvtier.store")

class Reservation(NamedTuple):
    reservation_id: int
    hashes: tuple[bytes, ...]
    statuses: tuple[PutStatus, ...]
    slots: tuple[tuple[TierKind, int] | None, ...]  # where each STORED block must be written


def make_tier(ns: Namespace, cfg: TierConfig) -> Tier:
    """Build a tier from its config, importing only the chosen implementation."""
    if cfg.kind is TierKind.GPU:
        from kvstore.tiers.gpu import GpuTier
        return GpuTier(cfg.capacity_blocks, ns.block_bytes, cfg.device)
    if cfg.kind is TierKind.DRAM:
        from kvstore.tiers.dram import DramTier
        return DramTier(cfg.capacity_blocks, ns.block_bytes)
    from kvstore.tiers.ssd import SsdTier
    return SsdTier(ns, cfg.path, cfg.capacity_blocks, durable=cfg.durable)


class TieredStore(Reads, Grants):
    def __init__(self, ns: Namespace, config: StoreConfig) -> None:
        self.ns, self.config = ns, config
        self._lock = threading.Lock()
        tiers: list[Tier] = []
        try:  # a store that fails to open holds nothing afterwards (memory, descriptors)
            for cfg in config.tiers:
                tiers.append(make_tier(ns, cfg))
            self._p = TierMap(tiers, config.node_id, config.event_buffer, ns.block_bytes)
            self._p.recover()
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        self._reservations: dict[int, tuple[float, list[Entry]]] = {}  # id -> (deadline, entries)
        # reservations made for a writer outside the daemon (a same-host client writing its
        # DRAM slots itself), by id -> that writer; and, per writer, the DRAM slots of its
        # reservations that timed out, by id: kept from reuse until it is done with them or
        # ends (they count against its limits meanwhile: see num_quarantined)
        self._owners: dict[int, object] = {}
        self._quarantined: dict[object, dict[int, list[Entry]]] = {}
        self._granted: set[int] = set()  # DRAM slots granted to same-host writers (grants.py)
        self._leases: dict[int, tuple[float, list[Entry]]] = {}
        self._ids = itertools.count(1)
        self._num_misses = 0
        self._num_write_errors = 0       # puts a tier could not store (NO_SPACE)
        self._num_background_errors = 0  # maintenance passes that failed
        self._closed = False
        self._stop = threading.Event()
        self._bg: threading.Thread | None = None
        if config.background_interval_s:
            self._bg = threading.Thread(target=self._background, name="kvtier-maintain", daemon=True)
            self._bg.start()

    # ---------------------------------------------------------------- writes

    def put_n(self, hashes: Sequence[bytes], srcs) -> list[PutStatus]:
        """Store blocks: `srcs` is one buffer holding len(hashes) blocks back to back, or a
        list of block buffers (tensors, numpy arrays, bytes-like). Sizes are checked first."""
        rows = byte_rows(srcs, len(hashes), self.ns.block_bytes)
        res = self.reserve_n(hashes, timeout_s=math.inf)
        try:
            self._write_reserved(res, rows)
        except TierIOError as e:
            return self.abort_failed(res, e)
        except BaseException:
            self.abort(res.reservation_id)
            raise
        self.commit(res.reservation_id)
        return list(res.statuses)

    def abort_failed(self, res: Reservation, error: Exception) -> list[PutStatus]:
        """A reservation whose bytes a tier could not take (disk full, I/O error): give it
        back; its new blocks are NO_SPACE, nothing was stored."""
        log.warning("a put of %d blocks was not stored: %s", len(res.hashes), error)
        self.abort(res.reservation_id)
        with self._lock:
            self._num_write_errors += 1
        # a block the batch named twice is NO_SPACE both times (its second was EXISTS: the
        # first was to store it)
        placed = {h for h, s in zip(res.hashes, res.statuses) if s is PutStatus.STORED}
        return [PutStatus.NO_SPACE if s is PutStatus.STORED or h in placed else s
                for h, s in zip(res.hashes, res.statuses)]

    def put_encoded_n(self, blobs: Sequence) -> list[PutStatus]:
        """Store encoded blocks (header + payload, as on the wire or on disk). Each is checked
        for this namespace, its size and its checksum before anything is stored."""
        decoded = [decode_block(self.ns, blob) for blob in blobs]
        return self.put_n([h.block_hash for h, _ in decoded], [payload for _, payload in decoded])

    def reserve_n(self, hashes: Sequence[bytes], timeout_s: float | None = None,
                  owner: object | None = None) -> Reservation:
        """Phase one of a put: a slot for each new hash, invisible until `commit`. A
        reservation not committed within `timeout_s` (default from the config) is reclaimed.
        `owner`: the writer filling its DRAM slots from outside the store (a same-host
        client, which may still be writing when the timeout passes): those slots of a
        reclaimed reservation are not reused until `release_owned(owner, id)` or
        `end_owner(owner)` says it is done with them."""
        keys = hash_keys(hashes)
        timeout = self.config.reservation_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            self._check_open()
            p = self._p
            entries = p.entries
            if len(keys) == 1 and keys[0] not in entries \
                    and (len(p.tiers) == 1 or p.tiers[0].num_free()):
                return self._reserve_one(keys[0], timeout, owner)
            # the blocks stored already are held: making room never takes them (a batch of
            # fresh blocks, the common case, has none to hold)
            unique = dict.fromkeys(keys)
            mine = self._hold(unique) if any(h in entries for h in keys) else [None] * len(unique)
            if len(p.tiers) == 1 or p.tiers[0].num_free() >= len(keys):
                # no bytes to move first (room is there, or made by dropping): one visit
                try:
                    return self._reserve_locked(keys, timeout, owner)
                finally:
                    self._unhold([e for e in mine if e is not None])
            fresh = mine.count(None)
        try:
            self._make_room_in(0, fresh)
        finally:
            with self._lock:
                self._unhold([e for e in mine if e is not None])
        with self._lock:
            self._check_open()
            return self._reserve_locked(keys, timeout, owner)

    def _reserve_locked(self, keys: list[bytes], timeout: float,
                        owner: object | None = None) -> Reservation:
        """Slots for the hashes not stored yet (under the lock; the fastest tier's room was
        made already, or is made by dropping)."""
        p = self._p
        entries = p.entries
        # EXISTS only for blocks stored: a hash another put has reserved is stored again
        # here (told EXISTS, a put whose twin then failed on a full disk, or whose client
        # went away, had stored nothing); whichever commits first keeps it (`TierMap.claim`)
        known = {h for h in keys if h in entries}
        if known:
            known = {h for h in known if entries[h].state is State.COMMITTED}
        if known:
            p.touch([entries[h] for h in keys if h in known])  # don't evict them for this put
            fresh = [h for h in dict.fromkeys(keys) if h not in known]
        else:
            fresh = list(dict.fromkeys(keys))
        where = dict(zip(fresh, p.allocate(len(fresh), demote=False)))
        statuses, slots, new, placed = [], [], [], set()
        for h in keys:
            place = where.pop(h, None)
            if place is None:  # (stored, the batch's second of it, or no room)
                statuses.append(PutStatus.EXISTS if h in known or h in placed
                                else PutStatus.NO_SPACE)
                slots.append(None)
                continue
            entry = Entry(h, place[0], place[1], State.RESERVED)
            entries.setdefault(h, entry)  # (another put's reservation stays the map's)
            placed.add(h)
            new.append(entry)
            statuses.append(PutStatus.STORED)
            slots.append((p.tiers[place[0]].kind, place[1]))
        rid = next(self._ids)
        self._reservations[rid] = (time.monotonic() + timeout, new)
        if owner is not None:
            self._owners[rid] = owner
        return Reservation(rid, tuple(keys), tuple(statuses), tuple(slots))

    def _reserve_one(self, h: bytes, timeout: float, owner: object | None) -> Reservation:
        """`_reserve_locked` for a single block not stored yet, with room in the fastest
        tier or no tier below it (a single block's put, the common case: half the calls)."""
        p = self._p
        place = p.allocate_one()
        rid = next(self._ids)
        if owner is not None:
            self._owners[rid] = owner
        if place is None:
            self._reservations[rid] = (time.monotonic() + timeout, [])
            return Reservation(rid, (h,), (PutStatus.NO_SPACE,), (None,))
        entry = Entry(h, place[0], place[1], State.RESERVED)
        p.entries[h] = entry
        self._reservations[rid] = (time.monotonic() + timeout, [entry])
        return Reservation(rid, (h,), (PutStatus.STORED,), ((p.tiers[place[0]].kind, place[1]),))

    def write_reserved(self, res: Reservation, srcs) -> None:
        """Fill a reservation's STORED blocks from `srcs` (one per hash of the reservation)."""
        self._write_reserved(res, byte_rows(srcs, len(res.statuses), self.ns.block_bytes))

    def _write_reserved(self, res: Reservation, rows) -> None:
        todo = [i for i, st in enumerate(res.statuses) if st is PutStatus.STORED]
        by_tier: dict[TierKind, list[int]] = {}
        for i in todo:
            by_tier.setdefault(res.slots[i][0], []).append(i)
        for kind, idx in by_tier.items():
            self._tier_of(kind).write_n([res.slots[i][1] for i in idx],
                                        [res.hashes[i] for i in idx], select_rows(rows, idx))

    def commit(self, reservation_id: int) -> None:
        """Phase two: the reserved blocks become readable (the batch's tail is the oldest)."""
        with self._lock:
            p = self._p
            entries = p.claim(self._take_reservation(reservation_id))
            for e in reversed(entries):
                p.make_evictable(e)
            for tier_idx, group in group_by_tier(entries):
                hashes = [e.hash for e in group]
                p.tiers[tier_idx].publish_n([e.slot for e in group], hashes)
                p.counters[tier_idx].bytes_in += len(group) * p.block_bytes
                p.emit(EventKind.STORED, tier_idx, hashes)

    def abort(self, reservation_id: int) -> None:
        """Give back a reservation's slots; its blocks were never visible."""
        with self._lock:
            self._p.release_reserved(self._take_reservation(reservation_id))

    def _take_reservation(self, reservation_id: int) -> list[Entry]:
        if reservation_id not in self._reservations:
            raise ReservationError(f"reservation {reservation_id} is unknown, already committed "
                                   "or aborted, or was reclaimed after its timeout")
        self._owners.pop(reservation_id, None)
        return self._reservations.pop(reservation_id)[1]

    def keep_reservation(self, reservation_id: int) -> None:
        """No timeout for this reservation any more: the daemon is filling it now (a
        COMMIT's inline blocks), and only commit or abort end it. ReservationError if it
        is gone already."""
        with self._lock:
            if reservation_id not in self._reservations:
                self._take_reservation(reservation_id)  # raises, saying why
            self._reservations[reservation_id] = (math.inf, self._reservations[reservation_id][1])

    def _expire_reservation(self, rid: int) -> None:
        """Under the lock: a reservation past its timeout is reclaimed. Its blocks were
        never visible; their slots go back, but the DRAM slots an outside writer may still
        be filling stay out of use (quarantined) until that writer is done (see reserve_n),
        however long it takes: reused before, its late bytes would land in another block.
        (They had gone back after one more timeout: a writer stalled past twice the timeout
        still wrote into another block. What an owner keeps counts against its limits.)"""
        entries = self._reservations.pop(rid)[1]
        owner = self._owners.pop(rid, None)
        if owner is None:
            self._p.release_reserved(entries)
            return
        dram = self._tier_index(TierKind.DRAM)
        held = [e for e in entries if e.tier == dram]
        self._p.forget_reserved(held)  # the hashes may be put again meanwhile
        self._p.release_reserved([e for e in entries if e.tier != dram])
        if held:
            self._quarantined.setdefault(owner, {})[rid] = held

    def num_quarantined(self, owner: object) -> tuple[int, int]:
        """(reservations, blocks) of `owner`'s kept out of use after their timeout: they
        count against its limits as if still open."""
        with self._lock:
            mine = self._quarantined.get(owner, {})
            return len(mine), sum(len(held) for held in mine.values())

    def release_owned(self, owner: object, reservation_id: int) -> bool:
        """`owner` is done with a reservation it no longer holds open (it sent COMMIT or
        ABORT for it after its timeout): its DRAM slots back into use, or, not reclaimed
        yet, the reservation aborted now. Whether there was anything."""
        with self._lock:
            if self._owners.get(reservation_id) is owner:
                self._p.release_reserved(self._take_reservation(reservation_id))
                return True
            mine = self._quarantined.get(owner, {})
            held = mine.pop(reservation_id, None)
            if not mine:
                self._quarantined.pop(owner, None)
            if held and not self._closed:
                self._p.release_reserved(held)
            return held is not None

    def end_owner(self, owner: object) -> None:
        """`owner` is gone (its connection closed): every slot it kept out of use goes back."""
        with self._lock:
            mine = self._quarantined.pop(owner, {})
            for rid in [r for r, o in self._owners.items() if o is owner]:
                del self._owners[rid]  # (its open reservations are aborted by the caller)
            if not self._closed:
                for held in mine.values():
                    self._p.release_reserved(held)

    # ---------------------------------------------------------------- reads

    def contains_n(self, hashes: Sequence[bytes]) -> list[bool]:
        keys = hash_keys(hashes)
        with self._lock:
            self._check_open()
            return [visible(self._p.entries.get(h)) for h in keys]

    def match_prefix(self, hashes: Sequence[bytes]) -> MatchResult:
        """The longest prefix of `hashes` that is stored, and the tier of each block."""
        keys = hash_keys(hashes)
        with self._lock:
            self._check_open()
            tiers = []
            for h in keys:
                e = self._p.entries.get(h)
                if not visible(e):
                    break
                tiers.append(self._p.tiers[e.tier].kind)
            return MatchResult(len(tiers), tuple(tiers))

    # ---------------------------------------------------------------- leases and pins

    def pin_n(self, hashes: Sequence[bytes], ttl_s: float | None = None) -> list[bool]:
        """Keep blocks from eviction: hard (ttl_s None; counted, until `unpin_n`) or soft
        (until ttl_s passes). Returns whether each block was present to pin."""
        if ttl_s is not None and not 0 < ttl_s < math.inf:  # (NaN: it pinned nothing, said
            raise ValueError(  # True; inf: a soft pin that never ended, no hard pin's count)
                f"a soft pin's ttl_s is a finite number of seconds above 0, not {ttl_s} "
                "(for a pin until unpin_n, leave ttl_s None)")
        keys = hash_keys(hashes)
        now = time.monotonic()
        with self._lock:
            self._check_open()
            out = []
            for h in keys:
                e = self._p.entries.get(h)
                out.append(visible(e))
                if not visible(e):
                    continue
                if ttl_s is None:
                    e.hard_pins += 1
                else:
                    e.soft_until = max(e.soft_until, now + ttl_s)
                    self._p.soft_pinned[h] = e
                self._p.hold(e)
            return out

    def unpin_n(self, hashes: Sequence[bytes]) -> None:
        """Drop one hard pin and any soft pin of each block."""
        keys = hash_keys(hashes)
        with self._lock:
            self._check_open()
            for h in keys:
                e = self._p.entries.get(h)
                if not visible(e):
                    continue
                e.hard_pins = max(0, e.hard_pins - 1)
                e.soft_until = 0.0
                self._p.soft_pinned.pop(h, None)
                self._p.make_evictable(e)

    def evict_n(self, hashes: Sequence[bytes]) -> int:
        """Demote the given evictable blocks one tier (drop from the last); blocks that are
        pinned, leased or absent stay. Returns how many moved."""
        keys = list(dict.fromkeys(hash_keys(hashes)))
        with self._lock:
            self._check_open()
            p = self._p
            groups = [[p.entries[h] for h in keys if h in lru] for lru in p.lru]  # before moving
            for e in (e for group in groups for e in group):
                p.hold(e)  # all out of the LRUs first, so making room never picks one of them
            for tier_idx, group in enumerate(groups):
                p.demote_or_drop(tier_idx, group)
            return sum(map(len, groups))

    def remove_n(self, hashes: Sequence[bytes]) -> int:
        """Delete blocks from every tier, pinned ones included; blocks a reader holds right
        now stay (remove again after its lease ends). Returns how many went."""
        keys = hash_keys(hashes)
        with self._lock:
            self._check_open()
            p = self._p
            group = [p.entries[h] for h in dict.fromkeys(keys)
                     if visible(p.entries.get(h)) and p.entries[h].readers == 0]
            p.drop(group, removed=True)
            # every persistent tier, not only those the blocks were in: one a block left
            # earlier (promoted out of SSD) may still hold its entry's delete, queued; an
            # entry left there could bring the removed block back (from a lost header
            # file's rebuild), the bytes still in their slot
            tiers = [t for t in p.tiers if t.persistent] if group else []
        for tier in tiers:  # outside the lock: an acknowledged remove survives a crash
            tier.persist_frees()
        return len(group)

    def clear(self) -> int:
        """Remove every block no reader holds; returns how many went."""
        return self.remove_n(self.list_hashes())

    def list_hashes(self) -> list[bytes]:
        """The hashes of every stored (committed) block."""
        with self._lock:
            self._check_open()
            return [h for h, e in self._p.entries.items() if visible(e)]

    # ---------------------------------------------------------------- housekeeping

    def maintain(self) -> None:
        """Reclaim expired reservations and leases, expire soft pins, evict every tier
        above its high watermark down to its low watermark, and write what the SSD index
        has queued."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            for rid in [r for r, (dl, _) in self._reservations.items() if dl < now]:
                self._expire_reservation(rid)
            for lid in [l for l, (dl, _) in self._leases.items() if dl < now]:
                self._unhold(self._leases.pop(lid)[1])
            self._p.expire_soft_pins(now)
        self._make_room(self._over_watermarks)
        for tier in self._p.tiers:  # (fixed at open) outside the lock: the SSD index's
            # queued writes go now
            tier.persist_frees()

    def _over_watermarks(self, p: TierMap) -> list[Move]:
        moves = []
        for i, (tier, cfg) in enumerate(zip(p.tiers, self.config.tiers)):
            used = tier.num_used()  # not num_slots - num_free(): a disk that refused to grow
            if used > cfg.high_watermark * tier.num_slots:  # leaves no free slot, yet the
                excess = used - int(cfg.low_watermark * tier.num_slots)  # tier is not full
                moves += p.plan_room(i, tier.num_free() + excess)
        return moves

    def _make_room_in(self, i: int, n: int, drop: bool = True) -> None:
        """Best effort: n free slots in tier i, the way a put wants them (two-phase, lower
        tiers first so a middle tier's victims have somewhere to go; the last tier, DRAM
        alone included, makes room by dropping its LRU blocks). `drop` False (a promotion:
        it adds no block): only what the tiers below have free room for moves, and no
        block leaves the store."""
        with self._lock:
            if self._closed or i >= len(self._p.tiers):
                return
            need = n - self._p.tiers[i].num_free()
            cascade = (need > 0 and i + 2 < len(self._p.tiers)
                       and self._p.tiers[i + 1].num_free() < need)
        if need <= 0:
            return
        if cascade:
            self._make_room_in(i + 1, need, drop)
        self._make_room(lambda p: p.plan_room(i, n, drop))

    def _make_room(self, plan) -> None:
        """Demotion in three steps, so no tier is written under the lock: `plan(tier_map)`
        picks victims and reserves their new slots (locked), the copies run unlocked, the
        moves commit (locked). Meanwhile the victims stay readable where they were."""
        with self._lock:
            if self._closed:
                return
            moves = plan(self._p)
        if not moves:
            return
        done = self._p.run_moves(moves)
        with self._lock:
            if self._closed:
                return  # the tiers are gone, and the moves with them
            self._p.commit_moves(moves, done)

    def _background(self) -> None:
        """`maintain()` on a timer; an error is logged and counted (`stats().background_errors`)
        and the thread carries on, so one bad disk moment never stops eviction for good.
        A background thread (SCHED_BATCH): its timer never preempts a caller's put or get."""
        background_thread("kvtier-maintain")
        while not self._stop.wait(self.config.background_interval_s):
            try:
                self.maintain()
            except Exception:  # noqa: BLE001 - logged with its traceback, counted
                log.exception("background maintenance of %r failed; retrying", self.ns.model)
                with self._lock:
                    self._num_background_errors += 1

    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain, in seq order (a gap: the buffer overflowed)."""
        with self._lock:
            return self._p.take_events()

    def snapshot(self) -> tuple[int, dict[TierKind, list[bytes]]]:
        """The store's whole content by tier, as of its last event: (that event's seq, or -1
        before any, and the blocks). Undrained events, all covered by it, are dropped, so
        `drain_events` continues right after the snapshot."""
        with self._lock:
            self._check_open()
            p = self._p
            p.events.clear()
            blocks: dict[TierKind, list[bytes]] = {t.kind: [] for t in p.tiers}
            for h, e in p.entries.items():
                if visible(e):
                    blocks[p.tiers[e.tier].kind].append(h)
            return p.seq - 1, blocks

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats.collect(self.ns, self._p.tiers, self._p.counters, self._num_misses,
                                      len(self._reservations), len(self._leases),
                                      self._num_write_errors, self._num_background_errors)

    @property
    def tier_kinds(self) -> tuple[TierKind, ...]:
        return tuple(t.kind for t in self._p.tiers)

    def tier(self, kind: TierKind) -> Tier:
        """The tier of a kind (e.g. the DRAM tier, for its shared-memory name)."""
        return self._tier_of(kind)

    def _tier_of(self, kind: TierKind) -> Tier:
        for t in self._p.tiers:
            if t.kind is kind:
                return t
        raise KeyError(f"this store has no {kind.name} tier (it has "
                       f"{', '.join(k.name for k in self.tier_kinds)})")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the store for {self.ns.model!r} is closed")

    def close(self, flush: bool = True) -> None:
        """Stop. With flush, memory-tier blocks are first written to the persistent last tier
        (as far as it has room) so a restart finds them. Later calls raise StoreClosedError."""
        self._stop.set()
        if self._bg is not None:
            self._bg.join()
        with self._lock:
            if self._closed:
                return
            if flush and self._p.tiers[-1].persistent:
                try:
                    missed = self._p.flush_to_last()
                except Exception as e:  # noqa: BLE001 - a full disk: keep what made it
                    missed = f"some ({e})"
                if missed:
                    log.error("closing %r: %s memory-tier blocks could not be written to SSD "
                              "(disk full?); the blocks already there are intact",
                              self.ns.model, missed)
            self._closed = True
            for tier in self._p.tiers:
                tier.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
