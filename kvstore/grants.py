"""Granted DRAM slots: the store side of same-host puts with no request.

A same-host writer is granted free DRAM slots ahead of time (`grant_n`), copies blocks into
them itself, and later names which hash each slot holds (`commit_granted`): the store then
binds and publishes them, as a reservation's commit would. A hash the store already holds
gives its slot back (EXISTS: content-addressed, nothing is lost). Slots granted and never
committed go back with `release_granted` (the daemon does it when the writer's channel
closes). Until committed, a granted slot belongs to no block: nothing reads or evicts it.
"""
from __future__ import annotations

from typing import Sequence

from kvstore.api import PutStatus
from kvstore.events import EventKind, TierKind
from kvstore.tiermap import Entry, State


GRANTED_SHARE = 4  # the stocks writers keep granted ahead: 1/4 of the DRAM tier, shared
# (kvstore.daemon.putchannel gives each channel its part)
BATCH_SHARE = 2  # what all writers together may hold granted: stocks, a batch bigger than a
# stock (FLUSH want), and a stock kept from before other writers came


class Grants:
    """Mixin of TieredStore (its lock `_lock`, tier map `_p`, `_granted`)."""

    def grant_n(self, n: int, share: int = GRANTED_SHARE) -> list[int]:
        """Up to n free DRAM slots reserved for a same-host writer (room made below first),
        as long as all writers together hold at most 1/share of the DRAM tier (a stock
        kept ahead: 1/GRANTED_SHARE; a batch about to be written: up to 1/BATCH_SHARE)."""
        i = self._tier_index(TierKind.DRAM)
        if i is None:
            return []
        with self._lock:  # no room is made for slots the share will not grant
            n = min(n, self._grantable(self._p.tiers[i], share))
        if n <= 0:
            return []
        self._make_room_in(i, n)
        with self._lock:
            self._check_open()
            tier = self._p.tiers[i]
            k = min(n, tier.num_free(), self._grantable(tier, share))
            slots = (tier.alloc_n(k) if k > 0 else None) or []
            self._granted.update(slots)
            return slots

    def _grantable(self, tier, share: int) -> int:
        """Under the lock: how many more slots of `tier` all writers together may hold
        granted within 1/share of it."""
        return tier.num_slots // share - len(self._granted)

    def commit_granted(self, hashes: Sequence[bytes], slots: Sequence[int]) -> list[PutStatus]:
        """Bind each granted slot to the block written into it and publish it. Per block:
        STORED, EXISTS (its slot given back) or NO_SPACE (that slot was not granted)."""
        with self._lock:
            self._check_open()
            p, i, granted = self._p, self._tier_index(TierKind.DRAM), self._granted
            mine = []  # (batch index, entry) of each granted slot, claimed in one pass below
            out: list[PutStatus] = [PutStatus.NO_SPACE] * len(slots)
            for k, (h, slot) in enumerate(zip(hashes, slots)):
                if slot in granted:
                    granted.discard(slot)
                    mine.append((k, Entry(bytes(h), i, slot, State.RESERVED)))
            # a hash stored already is EXISTS, its slot given back (a put of it still
            # reserved loses it to this one: `TierMap.claim`); one entry list, not one per
            # block (a drain of ~15 records spent ~1 us a block on the lists and calls)
            new = p.claim([e for _, e in mine])
            committed = State.COMMITTED
            for k, e in mine:
                out[k] = PutStatus.STORED if e.state is committed else PutStatus.EXISTS
            for e in reversed(new):
                p.make_evictable(e)
            if new:
                p.tiers[i].publish_n([e.slot for e in new], [e.hash for e in new])
                p.counters[i].bytes_in += len(new) * self.ns.block_bytes
                p.emit(EventKind.STORED, i, [e.hash for e in new])
        return out

    def release_granted(self, slots: Sequence[int]) -> None:
        """Granted slots nobody will commit go back to the free list."""
        with self._lock:
            if self._closed:
                return
            mine = [s for s in slots if s in self._granted]
            self._granted.difference_update(mine)
            i = self._tier_index(TierKind.DRAM)
            if mine and i is not None:
                self._p.tiers[i].free_n(mine, [b""] * len(mine))
