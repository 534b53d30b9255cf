"""TierMap: which block is in which slot of which tier, the LRU lists, and demotion.

Not thread-safe: every method runs under the TieredStore's lock. Invariant: a hash is in
`lru[t]` exactly when its entry lives in tier t and is evictable (committed, no readers,
no hard pin, no live soft pin).
"""
from __future__ import annotations

import collections
import enum
import time
from typing import NamedTuple, Sequence

from kvstore.errors import TierIOError
from kvstore.events import EventKind, KVEvent
from kvstore.stats import TierCounters
from kvstore.tiers.base import Tier


class State(enum.Enum):
    RESERVED = 0
    COMMITTED = 1


class Entry:
    __slots__ = ("hash", "tier", "slot", "state", "readers", "hard_pins", "soft_until")

    def __init__(self, block_hash: bytes, tier: int, slot: int, state: State) -> None:
        self.hash, self.tier, self.slot, self.state = block_hash, tier, slot, state
        self.readers = 0
        self.hard_pins = 0
        self.soft_until = 0.0

    def evictable(self) -> bool:
        """Committed, unread, unpinned, and no live soft pin (the clock is read only for a
        block that had a soft pin)."""
        if self.state is not State.COMMITTED or self.readers or self.hard_pins:
            return False
        return not self.soft_until or self.soft_until <= time.monotonic()


def visible(e: Entry | None) -> bool:
    return e is not None and e.state is State.COMMITTED


def group_by_tier(entries: Sequence[Entry]) -> list[tuple[int, list[Entry]]]:
    if len(entries) == 1:  # a single block's put, get or eviction: no dict, no sort
        return [(entries[0].tier, list(entries))]
    groups: dict[int, list[Entry]] = {}
    for e in entries:
        groups.setdefault(e.tier, []).append(e)
    return sorted(groups.items())


class Move(NamedTuple):
    """Blocks of tier `src` on their way to reserved slots of tier `dst`."""

    src: int
    dst: int
    entries: list[Entry]
    dst_slots: list[int]


class TierMap:
    def __init__(self, tiers: Sequence[Tier], node_id: str, event_buffer: int, block_bytes: int) -> None:
        self.tiers = list(tiers)
        self.node_id, self.block_bytes = node_id, block_bytes
        self.entries: dict[bytes, Entry] = {}
        self.lru = [collections.OrderedDict() for _ in self.tiers]  # hash -> None, oldest first
        self.soft_pinned: dict[bytes, Entry] = {}
        self.counters = [TierCounters() for _ in self.tiers]
        # (kind, seq, tier, hashes) per event: the KVEvents are built when drained (a frozen
        # dataclass costs ~2 us to make, and every put emits one or two)
        self.events: collections.deque[tuple] = collections.deque(maxlen=event_buffer)
        self.seq = 0

    def emit(self, kind: EventKind, tier_idx: int, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.events.append((kind, self.seq, self.tiers[tier_idx].kind, tuple(hashes)))
            self.seq += 1

    def take_events(self) -> list[KVEvent]:
        """Every event emitted since the last take, oldest first."""
        out = [KVEvent(kind, self.node_id, seq, tier, hashes)
               for kind, seq, tier, hashes in self.events]
        self.events.clear()
        return out

    def recover(self) -> None:
        for i, tier in enumerate(self.tiers):
            found = tier.recover()
            for h, slot in found:
                e = Entry(h, i, slot, State.COMMITTED)
                self.entries[h] = e
                self.lru[i][h] = None
            tier.publish_n([slot for _, slot in found], [h for h, _ in found])
            self.emit(EventKind.STORED, i, [h for h, _ in found])

    # -------------------------------------------------------------- evictability

    def make_evictable(self, e: Entry) -> None:
        """Put an entry at the MRU end of its tier's LRU if nothing holds it."""
        if e.evictable():
            lru = self.lru[e.tier]
            lru[e.hash] = None
            lru.move_to_end(e.hash)

    def touch(self, entries: Sequence[Entry]) -> None:
        """Mark blocks just used: MRU end of their LRU, the batch's tail the oldest."""
        for e in reversed(entries):
            if e.hash in self.lru[e.tier]:
                self.lru[e.tier].move_to_end(e.hash)

    def hold(self, e: Entry) -> None:
        self.lru[e.tier].pop(e.hash, None)

    def expire_soft_pins(self, now: float) -> None:
        for h in [h for h, e in self.soft_pinned.items() if e.soft_until <= now]:
            e = self.soft_pinned.pop(h)
            e.soft_until = 0.0
            self.make_evictable(e)

    # -------------------------------------------------------------- allocation

    def allocate(self, n: int, demote: bool = True) -> list[tuple[int, int]]:
        """Up to n (tier, slot) pairs, fastest tier first, evicting LRU blocks downwards.
        With demote=False only the last tier evicts (by dropping: no bytes move here); the
        others give what is free, the caller having made room with `plan_room` first."""
        out: list[tuple[int, int]] = []
        for i in range(len(self.tiers)):
            want = n - len(out)
            if want == 0:
                break
            evict = demote or i + 1 == len(self.tiers)
            if evict:
                self.make_room(i, want)
            out.extend((i, s) for s in self._take_slots(i, want, evict) or ())
        return out

    def allocate_one(self) -> tuple[int, int] | None:
        """`allocate(1, demote=False)` where the fastest tier has a free slot or is the only
        tier (the caller checked): its (tier, slot), or None."""
        last = len(self.tiers) == 1
        if last:
            self.make_room(0, 1)
        slots = self._take_slots(0, 1, last)
        return (0, slots[0]) if slots else None

    def _take_slots(self, i: int, n: int, evict: bool) -> list[int] | None:
        """Up to n of tier i's free slots. A tier that could not grow as its num_free said
        (a full disk) is asked again for what it has, after making room there when `evict`
        (the growth it counted had kept make_room from evicting anything)."""
        tier = self.tiers[i]
        slots = tier.alloc_n(min(n, tier.num_free()))
        if slots is None:
            if evict:
                self.make_room(i, n)
            slots = tier.alloc_n(min(n, tier.num_free()))
        return slots

    def make_room(self, i: int, n: int) -> None:
        """Evict from tier i until it has n free slots, or nothing more can go."""
        need = n - self.tiers[i].num_free()
        if need > 0:
            self.demote_or_drop(i, self.pick_victims(i, need))

    def pick_victims(self, i: int, n: int) -> list[Entry]:
        lru = self.lru[i]
        if len(lru) < n and self.soft_pinned:
            self.expire_soft_pins(time.monotonic())
        victims = []
        while lru and len(victims) < n:
            h, _ = lru.popitem(last=False)
            victims.append(self.entries[h])
        return victims

    def demote_or_drop(self, i: int, victims: list[Entry]) -> None:
        """Move victims (already out of the LRU) one tier down; drop what cannot move."""
        if not victims:
            return
        if i + 1 == len(self.tiers):
            self.drop(victims)
            return
        self.make_room(i + 1, len(victims))
        k = min(len(victims), self.tiers[i + 1].num_free())
        k = self.demote_to(i, i + 1, victims[:k])
        self.drop(victims[k:])

    def demote_to(self, src: int, dst: int, group: list[Entry]) -> int:
        """Copy blocks from tier src into free slots of tier dst (a lower, slower tier),
        here and now (under the lock: `evict_n`, `flush_to_last`; puts and the background
        pass use the two-phase `plan_room`). Returns how many moved: none when dst cannot
        take them (its disk is full, a write failed); the caller drops the rest."""
        if not group:
            return 0
        slots = self.tiers[dst].alloc_n(len(group))
        if slots is None:
            return 0
        hashes = [e.hash for e in group]
        src_tier = self.tiers[src]
        try:
            self.tiers[dst].write_n(slots, hashes, [src_tier.slot_view(e.slot) for e in group])
        except TierIOError:
            self.tiers[dst].free_n(slots, hashes)
            return 0
        self._switch(src, dst, list(zip(group, slots)))
        return len(group)

    def flush_to_last(self, chunk: int = 256) -> int:
        """Write every unleased memory-tier block to the last (persistent) tier, slowest
        memory tier first so the hottest blocks end up most recent there, in chunks so a
        disk that fills up midway keeps what fit. Returns how many blocks were not written."""
        last, missed = len(self.tiers) - 1, 0
        for i in range(last - 1, -1, -1):
            group = [self.entries[h] for h in self.lru[i]]
            group += [e for e in self.entries.values()
                      if e.tier == i and visible(e) and e.readers == 0 and e.hash not in self.lru[i]]
            for e in group:
                self.hold(e)
            self.make_room(last, len(group))
            group = group[:self.tiers[last].num_free()] if len(group) else group
            for k in range(0, len(group), chunk):
                part = group[k:k + chunk]
                missed += len(part) - self.demote_to(i, last, part)
        return missed

    # -------------------------------------------------------------- two-phase moves

    def plan_room(self, i: int, n: int, drop: bool = True) -> list["Move"]:
        """Phase one of making n slots free in tier i (under the lock): victims chosen,
        destination slots in tier i + 1 reserved (the last tier makes room by dropping);
        each victim counts a reader, so it stays readable at its slot and nothing else
        moves or removes it. Run the moves outside the lock, then `commit_moves`.
        `drop` False (room for a promotion, which adds no block to the store): no block
        leaves the store; only as many victims move as the tier below has free slots."""
        need = n - self.tiers[i].num_free()
        last = len(self.tiers) - 1
        if need <= 0 or i == last:
            if need > 0 and drop:
                self.make_room(i, n)
            return []
        dst = i + 1
        if not drop:
            need = min(need, self.tiers[dst].num_free())
        victims = self.pick_victims(i, need) if need > 0 else []
        if not victims:
            return []
        if dst == last and drop:
            self.make_room(dst, len(victims))
        k = min(len(victims), self.tiers[dst].num_free())
        slots = (self._take_slots(dst, k, dst == last and drop) if k else None) or []
        if drop:
            self.drop(victims[len(slots):])  # no room below (a full disk): dropped, as ever
        else:
            for e in victims[len(slots):]:  # back where they were
                self.make_evictable(e)
        moving = victims[:len(slots)]
        for e in moving:
            e.readers += 1
        return [Move(i, dst, moving, slots)] if moving else []

    def run_moves(self, moves: list["Move"]) -> list[bool]:
        """Phase two, outside the lock: copy each move's blocks. Whether each succeeded."""
        done = []
        for m in moves:
            src = self.tiers[m.src]
            try:
                self.tiers[m.dst].write_n(m.dst_slots, [e.hash for e in m.entries],
                                          [src.slot_view(e.slot) for e in m.entries])
                done.append(True)
            except TierIOError:
                done.append(False)
        return done

    def commit_moves(self, moves: list["Move"], done: list[bool]) -> None:
        """Phase three (under the lock): moved blocks switch to their new slots. A block a
        reader took meanwhile (it is reading the old slot), or whose copy failed, stays."""
        for m, ok in zip(moves, done):
            go, stay, give_back = [], [], []
            for e, slot in zip(m.entries, m.dst_slots):
                e.readers -= 1
                if ok and e.readers == 0 and self.entries.get(e.hash) is e:
                    go.append((e, slot))
                else:
                    stay.append(e)
                    give_back.append((slot, e.hash))
            if give_back:
                self.tiers[m.dst].free_n([s for s, _ in give_back], [h for _, h in give_back])
            for e in stay:
                if self.entries.get(e.hash) is e:
                    self.make_evictable(e)
            self._switch(m.src, m.dst, go)

    def _switch(self, src: int, dst: int, moved: list[tuple[Entry, int]]) -> None:
        if not moved:
            return
        hashes = [e.hash for e, _ in moved]
        self.tiers[src].free_n([e.slot for e, _ in moved], hashes)
        for e, slot in moved:
            e.tier, e.slot = dst, slot
        self.tiers[dst].publish_n([slot for _, slot in moved], hashes)
        self.counters[src].demotions_out += len(moved)
        self.counters[dst].demotions_in += len(moved)
        self.counters[dst].bytes_in += len(moved) * self.block_bytes
        self.emit(EventKind.REMOVED, src, hashes)
        self.emit(EventKind.STORED, dst, hashes)
        for e, _ in moved:
            self.make_evictable(e)

    def promote(self, group: list[Entry], rows: list) -> None:
        """Move blocks (leased by the caller alone) into free slots of the fastest tier,
        writing them from `rows`, the copies the caller just read. Nothing is evicted for
        it (that would write a lower tier under the lock): the background pass keeps the
        tier below its high watermark, so there is room."""
        k = min(len(group), self.tiers[0].num_free())
        if k == 0:
            return
        group, rows = group[:k], rows[:k]
        slots = self.tiers[0].alloc_n(k)
        self.tiers[0].write_n(slots, [e.hash for e in group], rows)
        for src, members in group_by_tier(group):
            hashes = [e.hash for e in members]
            self.tiers[src].free_n([e.slot for e in members], hashes)
            self.emit(EventKind.REMOVED, src, hashes)
        for e, slot in zip(group, slots):
            e.tier, e.slot = 0, slot
        self.tiers[0].publish_n(slots, [e.hash for e in group])
        self.counters[0].promotions_in += k
        self.counters[0].bytes_in += k * self.block_bytes
        self.emit(EventKind.STORED, 0, [e.hash for e in group])

    def drop(self, group: Sequence[Entry], corrupt: bool = False, removed: bool = False) -> None:
        """Remove blocks from the store entirely: last-tier eviction, corruption, or an
        explicit remove (which counts as neither). A block named twice (a read of a batch
        that named it twice, found corrupted at both) is removed once: its slot freed
        twice would be handed to two blocks."""
        if len(group) > 1:
            group = list({id(e): e for e in group}.values())
        for tier_idx, members in group_by_tier(group):
            hashes = [e.hash for e in members]
            self.tiers[tier_idx].free_n([e.slot for e in members], hashes)
            for e in members:
                del self.entries[e.hash]
                self.lru[tier_idx].pop(e.hash, None)
                self.soft_pinned.pop(e.hash, None)
            counters = self.counters[tier_idx]
            if corrupt:
                counters.corrupt += len(members)
            elif not removed:
                counters.evictions += len(members)
            self.emit(EventKind.REMOVED, tier_idx, hashes)

    def claim(self, group: list[Entry]) -> list[Entry]:
        """Reserved entries whose bytes are written become their hashes' blocks (COMMITTED,
        in the map): those of `group` that do, in order. One whose hash another put of it
        committed first is a twin: its slot goes back (content-addressed: the block is
        stored). One that commits first, while another put of the hash is still reserved,
        takes the hash from it (that put then finds it committed)."""
        entries, twins, committed = self.entries, [], State.COMMITTED
        for e in group:
            cur = entries.get(e.hash)
            if cur is not e:
                if cur is not None and cur.state is committed:
                    twins.append(e)
                    continue
                entries[e.hash] = e
            e.state = committed
        if not twins:
            return group
        self.release_reserved(twins)
        return [e for e in group if e.state is committed]

    def forget_reserved(self, group: Sequence[Entry]) -> None:
        """Reserved (never visible) entries leave the map, their slots still taken: the
        hashes may be put again; `release_reserved` frees the slots later."""
        for e in group:
            if self.entries.get(e.hash) is e:
                del self.entries[e.hash]

    def release_reserved(self, group: Sequence[Entry]) -> None:
        """Free the slots of reserved (never visible) entries. The entries go first, so even
        a tier that fails to clean up leaves no trace a later put could take for EXISTS."""
        for tier_idx, members in group_by_tier(group):
            for e in members:
                if self.entries.get(e.hash) is e:
                    del self.entries[e.hash]
            self.tiers[tier_idx].free_n([e.slot for e in members], [e.hash for e in members])
