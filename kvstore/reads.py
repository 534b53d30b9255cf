"""The read side of `TieredStore`: copies, leases, touches, and promotion on a hit.

Every read visits each hash once, in three steps: hold (under the store lock: a reader count
on each block, so nothing can move or evict it), copy (outside the lock, from the tiers into
the caller's rows; blocks a caller will copy itself from a leased slot are skipped), settle
(under the lock: hits and misses counted once, corrupted blocks dropped, readers released
or kept for a lease). A hit in a lower tier is promoted afterwards from the bytes just read:
room is made in the fastest tier with the same two-phase demotion puts use, so no tier is
written under the lock but the destination of the promotion itself (a memory tier).
"""
from __future__ import annotations

import collections
import logging
import time
from typing import NamedTuple, Sequence

from kvstore.api import MatchResult, leading_hits
from kvstore.buffers import byte_rows, select_rows
from kvstore.errors import LeaseError, TierIOError
from kvstore.events import TierKind
from kvstore.keys import check_hashes, hash_keys
from kvstore.tiermap import Entry, visible

log = logging.getLogger("kvtier.store")
TOUCH_CHUNK = 512  # blocks touch_n handles per visit under the lock (~0.3 ms)
NO_SLOT = -1  # fetch_n: a hit whose bytes were copied, not leased
DEFERRED = -2  # fetch_n: a hit held in the lease, its bytes still to copy (`read_deferred`)


class Lease(NamedTuple):
    lease_id: int
    hits: tuple[tuple[TierKind, int] | None, ...]  # (tier, slot) per requested hash; None = miss
    copied: tuple[bool, ...] = ()  # fetch_n: the block's bytes are in the caller's row
    rows: tuple[int, ...] = ()  # fetch_n with max_copied: which row that is (-1: none)


class Reads:
    """Mixin of TieredStore (its lock `_lock`, tier map `_p`, config, leases)."""

    def get_n(self, hashes: Sequence[bytes], dsts) -> list[TierKind | None]:
        """Copy each stored block into its destination (one writable buffer of all blocks, or
        one per block). Returns per block the tier it was found in, or None for a miss
        (absent, or found corrupted, in which case it is removed)."""
        rows = byte_rows(dsts, len(hashes), self.ns.block_bytes, writable=True)
        return self._read(hashes, rows)[1]

    def get_prefix_n(self, hashes: Sequence[bytes], dsts) -> MatchResult:
        """`match_prefix` and `get_n` in one visit: the longest stored prefix of `hashes`,
        its blocks copied into the first destinations (the rest are left untouched). A
        block found corrupted ends the prefix there."""
        rows = byte_rows(dsts, len(hashes), self.ns.block_bytes, writable=True)
        tiers = self._read(hashes, rows, prefix=True)[1]
        n = leading_hits(tiers)
        return MatchResult(n, tuple(tiers[:n]))

    def fetch_n(self, hashes: Sequence[bytes], rows, ttl_s: float = 30.0,
                lease_tier: TierKind | None = TierKind.DRAM, prefix: bool = False,
                max_copied: int | None = None):
        """One visit per hash for a reader that can copy slots of `lease_tier` itself (a
        same-host client mapping the DRAM arena): blocks there are leased (copy them, then
        `release`); the others are copied into their `rows` (and promoted where configured;
        one promoted into `lease_tier` is leased at its new slot too). Hits and misses are
        counted once. With `prefix`, only the longest stored prefix is read.
        `hits[i]` is (tier found in, leased slot or NO_SLOT) or None; `copied[i]` says the
        block's bytes are in `rows[i]`. `lease_id` is 0 when nothing is leased.

        With `max_copied` (a reader streaming a big batch out in windows: the daemon),
        `rows` holds only that many rows: the k-th block copied goes to `rows[k]` (in
        order), and the blocks past them are held in the lease, counted as hits, with
        DEFERRED for a slot: copy them with `read_deferred`."""
        n = len(hashes) if max_copied is None else min(len(hashes), max_copied)
        rows = byte_rows(rows, n, self.ns.block_bytes, writable=True)
        leased = self._lease_all(hashes, ttl_s, prefix, lease_tier)
        if leased is not None:
            return leased
        held, tiers, kept, copied, row_at = self._read(hashes, rows, prefix, lease_tier,
                                                      max_copied)
        with self._lock:
            lid = self._lease_kept(kept, ttl_s)
            lt, kept_ids = self._tier_index(lease_tier), {id(e) for e in kept}
            hits = tuple(None if t is None else
                         (t, e.slot if id(e) in kept_ids and e.tier == lt
                          else NO_SLOT if copied[i] else DEFERRED)
                         for i, (t, e) in enumerate(zip(tiers, held)))
        return Lease(lid, hits, tuple(copied),
                     tuple(r if c else -1 for r, c in zip(row_at, copied)) if row_at else ())

    def lease_n(self, hashes: Sequence[bytes], ttl_s: float = 30.0, prefix: bool = False,
                tier: TierKind = TierKind.DRAM) -> Lease | None:
        """`fetch_n` of a batch that needs no copy: when every hit lies in `tier`, one
        locked visit leases them (copy their slots, then `release`), hits and misses
        counted; None, with nothing held or counted, when some block lies elsewhere (for
        `fetch_n` to copy)."""
        return self._lease_all(hashes, ttl_s, prefix, tier)

    def read_deferred(self, lease_id: int, hashes: Sequence[bytes], rows) -> list[bool]:
        """Copy blocks a `fetch_n` deferred into `rows` (one per hash, in order; a hash the
        batch named twice, twice); each then leaves the lease. False for a block found
        corrupted: it is dropped, and counted a miss instead of the hit `fetch_n` counted.
        Raises LeaseError when a block is not deferred in that lease (never was, already
        read, or the lease ended)."""
        rows = byte_rows(rows, len(hashes), self.ns.block_bytes, writable=True)
        keys = hash_keys(hashes)
        with self._lock:
            self._check_open()
            _, entries = self._leases.get(lease_id, (0.0, []))
            where: dict[bytes, list[int]] = {}
            for j, e in enumerate(entries):
                where.setdefault(e.hash, []).append(j)
            taken = []
            for h in keys:  # one of the lease's holds per copy asked for
                if not where.get(h):
                    raise LeaseError(f"block {h.hex()} is not held in lease {lease_id} "
                                     "(read already, or the lease ended)")
                taken.append(where[h].pop())
            mine = [entries[j] for j in taken]
            gone = set(taken)
            entries[:] = [e for j, e in enumerate(entries) if j not in gone]
        try:
            ok = self._read_held(mine, rows)
            self._promote([(e, rows[k]) for k, (e, good) in enumerate(zip(mine, ok)) if good])
        except BaseException:
            with self._lock:  # out of the lease already: nothing else would give them back
                self._unhold(mine)
            raise
        with self._lock:
            p, corrupt = self._p, []
            for e, good in zip(mine, ok):
                if not good:
                    e.readers -= 1
                    corrupt.append(e)
                    p.counters[e.tier].hits -= 1  # counted by fetch_n: a miss after all
                    p.counters[e.tier].bytes_out -= p.block_bytes
                    self._num_misses += 1
            p.drop([e for e in corrupt if p.entries.get(e.hash) is e], corrupt=True)
            self._unhold([e for e, good in zip(mine, ok) if good])
        return ok

    def renew_lease(self, lease_id: int, ttl_s: float) -> None:
        """The lease now ends `ttl_s` from now unless released first (unknown: ignored)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._leases[lease_id] = (time.monotonic() + ttl_s, lease[1])

    def _lease_all(self, hashes: Sequence[bytes], ttl_s: float, prefix: bool,
                   lease_tier: TierKind | None) -> Lease | None:
        """`fetch_n` in one locked visit when no block needs copying (every hit is in
        `lease_tier`: a DRAM-resident batch, the common case); None, with nothing held or
        counted, when some block must be copied (the three steps below then)."""
        check_hashes(hashes)
        with self._lock:
            self._check_open()
            lt = self._tier_index(lease_tier)
            if lt is None:
                return None
            held = self._hold(hashes, prefix)
            if any(e is not None and e.tier != lt for e in held):
                self._unhold([e for e in held if e is not None])
                return None
            tiers, live = self._settle(held, [e is not None for e in held], prefix)
            kept = [e for e, t in live if t is not None]
            self._unhold([e for e, t in live if t is None])
            lid = self._lease_kept(kept, ttl_s)
            hits = tuple(None if t is None else (t, e.slot) for t, e in zip(tiers, held))
        return Lease(lid, hits, (False,) * len(hashes))

    def hold_n(self, hashes: Sequence[bytes], tier_kind: TierKind, prefix: bool = False
               ) -> tuple[list[TierKind | None], list[Entry]] | None:
        """For a reader that copies every hit straight out of `tier_kind`'s slots before it
        lets go (the daemon streaming DRAM slots to a TCP client): one locked visit that
        finds, holds and counts the blocks, as `fetch_n` would, with no lease to keep.
        Returns (the tier per hash or None, the entries held, in order: read `e.slot`,
        then give them back with `unhold_n`), or None, with nothing held or counted, when
        some block lies in another tier (`fetch_n` copies those). With `prefix`, only the
        longest stored prefix is held; the first miss ends it and is the one counted."""
        check_hashes(hashes)
        with self._lock:
            self._check_open()
            t = self._tier_index(tier_kind)
            if t is None:
                return None
            p = self._p
            get, kinds, held, misses = p.entries.get, [], [], 0
            for h in hashes:
                e = get(h if type(h) is bytes else bytes(h))
                if visible(e):
                    if e.tier != t:
                        return None
                    held.append(e)
                    kinds.append(tier_kind)
                else:
                    misses += 1
                    kinds.append(None)
                    if prefix:
                        kinds += [None] * (len(hashes) - len(kinds))
                        break
            self._num_misses += misses
            c, lru = p.counters[t], p.lru[t]
            c.hits += len(held)
            c.bytes_out += len(held) * p.block_bytes
            for e in held:
                e.readers += 1
                lru.pop(e.hash, None)
        return kinds, held

    def unhold_n(self, entries: Sequence[Entry]) -> None:
        """Give back the blocks `hold_n` held (they are recent now)."""
        if entries:
            with self._lock:
                self._unhold(entries)

    def _lease_kept(self, kept: list[Entry], ttl_s: float) -> int:
        """Under the lock: a lease on blocks a read kept held; its id, 0 when none were."""
        if not kept:
            return 0
        lid = next(self._ids)
        self._leases[lid] = (time.monotonic() + ttl_s, kept)
        return lid

    # ------------------------------------------------------------------ the three steps

    def _read(self, hashes: Sequence[bytes], rows, prefix: bool = False,
              lease_tier: TierKind | None = None, max_copied: int | None = None):
        """Hold, copy what will not be leased, settle, promote. Returns (the entry held per
        hash, the tier each was found in or None, the entries kept held for a lease, per
        hash whether its bytes were copied into its row, and with `max_copied` the row of
        `rows` each hash's copy went to, -1 for none, else None). Past `max_copied` blocks
        to copy, the rest are kept held uncopied (deferred: see fetch_n)."""
        check_hashes(hashes)
        with self._lock:
            self._check_open()
            held = self._hold(hashes, prefix)
            lt = self._tier_index(lease_tier)
        to_read = held if lt is None else [None if e is None or e.tier == lt else e
                                           for e in held]
        deferred: collections.Counter[int] = collections.Counter()  # id(entry) -> positions
        row_at = None
        if max_copied is not None:
            to_read, row_at, deferred = _defer_past(to_read, max_copied)
            rows = [None if k < 0 else rows[k] for k in row_at]
        try:
            ok = self._read_held(to_read, rows)
        except BaseException:
            with self._lock:  # nothing may stay held: every reader count goes back
                self._unhold([e for e in held if e is not None])
            raise
        if lt is not None or deferred:  # the blocks to lease or read later are good so far
            ok = [good or (e is not None and (e.tier == lt or r is None))
                  for e, r, good in zip(held, to_read, ok)]
        promoting = self.config.promote_on_hit and any(e is not None and e.tier > 0
                                                       for e in to_read)
        with self._lock:
            tiers, live = self._settle(held, ok, prefix)
            if not promoting:  # settle and release in one visit
                kept = self._release_unleased(live, lt, deferred)
        if promoting:
            self._promote([(e, rows[i]) for i, e in enumerate(held)
                           if e is not None and tiers[i] is not None and to_read[i] is not None])
            with self._lock:
                kept = self._release_unleased(live, lt, deferred)
        copied = [r is not None and t is not None for r, t in zip(to_read, tiers)]
        return held, tiers, kept, copied, row_at

    def _release_unleased(self, live: list[tuple[Entry, object]], lt: int | None,
                          deferred: collections.Counter[int]) -> list[Entry]:
        """Under the lock: release what a read held but will neither lease nor read later
        (`deferred`: how many of each entry's holds are kept to read later); returns the
        rest."""
        if lt is None and not deferred:  # nothing to lease or read later (get_n)
            self._unhold([e for e, _ in live])
            return []
        left = collections.Counter(deferred)
        kept, released = [], []
        for e, t in live:
            if t is not None and e.tier == lt:
                kept.append(e)
            elif t is not None and left[id(e)] > 0:
                left[id(e)] -= 1
                kept.append(e)
            else:
                released.append(e)
        self._unhold(released)
        return kept

    def _tier_index(self, kind: TierKind | None) -> int | None:
        index = self.__dict__.get("_kind_index")  # the tiers never change: built once
        if index is None:
            index = self._kind_index = {t.kind: i for i, t in enumerate(self._p.tiers)}
        return index.get(kind)

    def _hold(self, hashes: Sequence[bytes], prefix: bool = False) -> list[Entry | None]:
        """Reader counts on every visible block (with `prefix`: up to the first missing)."""
        held, stop = [], False
        for h in hashes:
            e = None if stop else self._p.entries.get(bytes(h))
            if visible(e):
                e.readers += 1
                self._p.hold(e)
                held.append(e)
            else:
                held.append(None)
                stop = prefix
        return held

    def _read_held(self, held: list[Entry | None], rows) -> list[bool]:
        ok = [False] * len(held)
        by_tier: dict[int, list[int]] = {}
        for i, e in enumerate(held):
            if e is not None:
                by_tier.setdefault(e.tier, []).append(i)
        for tier_idx, idx in by_tier.items():
            try:
                got = self._p.tiers[tier_idx].read_n([held[i].slot for i in idx],
                                                     [held[i].hash for i in idx],
                                                     select_rows(rows, idx))
            except TierIOError as e:  # the tier's blocks of this batch are misses, no more
                log.warning("a read of %d blocks failed: %s", len(idx), e)
                got = [False] * len(idx)
            for i, good in zip(idx, got):
                ok[i] = good
        return ok

    def _settle(self, held: list[Entry | None], ok: list[bool],
                prefix: bool) -> tuple[list[TierKind | None], list[tuple[Entry, object]]]:
        """Count hits and misses, drop corrupted blocks. With `prefix`, a miss or a
        corrupted block ends the read: what follows is reported as None, uncounted.
        Returns (tier per hash, the (entry, tier) pairs still held)."""
        p = self._p
        out: list[TierKind | None] = []
        corrupt, ended, bb = [], False, p.block_bytes
        for e, good in zip(held, ok):
            if ended or e is None or not good:
                out.append(None)
                if not ended:
                    self._num_misses += 1
                    ended = prefix
                    if e is not None:
                        e.readers -= 1
                        corrupt.append(e)
                continue
            out.append(p.tiers[e.tier].kind)
            p.counters[e.tier].hits += 1
            p.counters[e.tier].bytes_out += bb
        if not corrupt:
            return out, [(e, t) for e, t in zip(held, out) if e is not None]
        p.drop([e for e in corrupt if p.entries.get(e.hash) is e], corrupt=True)
        dropped = {id(e) for e in corrupt}
        return out, [(e, t) for e, t in zip(held, out) if e is not None and id(e) not in dropped]

    def _promote(self, hits: list[tuple[Entry, object]]) -> None:
        """Blocks just read from a lower tier move up to the fastest, from the bytes read
        (only those this reader alone holds: another may be copying the old slot)."""
        if not self.config.promote_on_hit:
            return
        hits = [(e, row) for e, row in hits if e.tier > 0]
        if not hits:
            return
        # room without dropping: a promotion adds no block to the store, so none may leave
        # it for one (the blocks promoted still held their slots below, and the victims
        # making room above found the tier below short by as many: the store lost blocks
        # to a read while it had room for every one)
        self._make_room_in(0, len(hits), drop=False)
        with self._lock:
            if self._closed:
                return
            mine = [(e, r) for e, r in hits
                    if self._p.entries.get(e.hash) is e and e.readers == 1 and e.tier > 0]
            if mine:
                self._p.promote([e for e, _ in mine], [r for _, r in mine])

    def _unhold(self, entries: list[Entry]) -> None:
        for e in reversed(entries):  # the batch's tail becomes the older end of the LRU
            if self._p.entries.get(e.hash) is not e:
                continue  # removed meanwhile (found corrupted by another reader)
            e.readers -= 1
            self._p.make_evictable(e)

    # ------------------------------------------------------------------ leases

    def acquire_n(self, hashes: Sequence[bytes], ttl_s: float = 30.0) -> Lease:
        """Hold blocks for zero-copy reading (e.g. another process mapping the DRAM arena):
        they cannot move or be evicted until `release(lease_id)` or until `ttl_s` passes."""
        check_hashes(hashes)
        with self._lock:
            self._check_open()
            held = self._hold(hashes)
            self._count_reads(held)
            lid = next(self._ids)
            self._leases[lid] = (time.monotonic() + ttl_s, [e for e in held if e is not None])
            kinds = [None if e is None else (self._p.tiers[e.tier].kind, e.slot) for e in held]
            return Lease(lid, tuple(kinds))

    def touch_n(self, hashes: Sequence[bytes], reads: Sequence[int] | None = None) -> int:
        """Count reads made outside the store (a same-host reader copying published DRAM
        slots itself) as hits, and mark those blocks recently used; `reads[i]` says how many
        times `hashes[i]` was read (default once). Returns how many of the reads were of
        blocks still stored (the others were evicted or removed since; not counted). Takes
        the lock TOUCH_CHUNK blocks at a time, the last chunk first (so the first block ends
        up the most recent, as in one `touch`): a big report never stalls the namespace."""
        check_hashes(hashes)
        found_reads = 0
        for lo in reversed(range(0, len(hashes), TOUCH_CHUNK)):
            with self._lock:
                self._check_open()
                p, found = self._p, []
                for i in range(lo, min(lo + TOUCH_CHUNK, len(hashes))):
                    e = p.entries.get(bytes(hashes[i]))
                    if visible(e):
                        k = 1 if reads is None else reads[i]
                        found.append(e)
                        c = p.counters[e.tier]
                        c.hits += k
                        c.bytes_out += k * self.ns.block_bytes
                        found_reads += k
                p.touch(found)
        return found_reads

    def _count_reads(self, held: list[Entry | None]) -> None:
        """Count a lease's hits and misses like a get's (its reader copies the bytes)."""
        for e in held:
            if e is None:
                self._num_misses += 1
            else:
                self._p.counters[e.tier].hits += 1
                self._p.counters[e.tier].bytes_out += self.ns.block_bytes

    def open_leases(self, lease_ids) -> set[int]:
        """Which of `lease_ids` are still open (the others were released or timed out)."""
        with self._lock:
            return {lid for lid in lease_ids if lid in self._leases}

    def release(self, lease_id: int) -> None:
        """End a lease (unknown or expired ids are ignored: the lease is already over)."""
        with self._lock:
            _, entries = self._leases.pop(lease_id, (0.0, []))
            self._unhold(entries)



def _defer_past(to_read: list[Entry | None], max_copied: int):
    """The first `max_copied` blocks to copy take a row each, in order (the k-th copied
    goes to row k); the ones past them are left to read later. Returns (what to copy now,
    by position; the row of each position, -1 where nothing is copied; how many positions
    each entry has left to read later, by id: a batch may name a block twice)."""
    now, row_at = list(to_read), [-1] * len(to_read)
    deferred: collections.Counter[int] = collections.Counter()
    k = 0
    for i, e in enumerate(now):
        if e is None:
            continue
        if k < max_copied:
            row_at[i], k = k, k + 1
        else:
            deferred[id(e)] += 1
            now[i] = None
    return now, row_at, deferred
