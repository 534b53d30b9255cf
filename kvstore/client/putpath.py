"""Same-host puts with no request: the client side of a put channel (kvstore.putring).

A dedicated local-socket connection asks for a put channel once; the daemon hands over a
ring in shared memory and an eventfd doorbell, and keeps granting DRAM slots through the
ring. A put then copies each new block into a granted slot of the arena this client maps,
appends (hash, slot) records, rings the doorbell and returns: STORED for what it wrote,
EXISTS for blocks the slot directory already shows. The daemon commits them shortly after;
`flush` (done before any request that must see them) waits for that with one FLUSH. A
batch bigger than the grants in stock is copied into what is granted while the drainer
grants more, and asks for the slots still missing with one FLUSH (`want`: the batch); when
the daemon cannot grant them (or the ring is full), the caller falls back to a put request.

A block the daemon already held outside DRAM (on SSD) is written again and reported
STORED here; the daemon keeps its copy and frees the slot (content-addressed: same bytes).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Sequence

from kvstore import wire as w
from kvstore.api import PutStatus
from kvstore.buffers import cpu_array
from kvstore.client.conn import Connection
from kvstore.client.shm import ArenaMap
from kvstore.keys import HASH_BYTES
from kvstore.putring import PutRing, fence
from transfer.copy import copy_at, copy_bytes
from transfer.shm import ShmSegment

REFUSED_RETRY_S = 1.0  # after a FLUSH that could not get a batch its slots, puts as big go
# by request this long before asking again


class DirectPuts:
    """One put channel. `conn` (a blocking client's) carries FLUSH; an asyncio client
    passes None and sends its FLUSH itself when `pending`."""

    def __init__(self, reply: w.PutsOk, fds: list[int], arena: ArenaMap,
                 conn: Connection | None = None) -> None:
        ring_fd, self.doorbell = fds
        if reply.arena_id != arena.arena_id:
            w.close_fds(fds)
            raise w.ProtocolError("the put channel's arena is not the one this client maps")
        try:
            self.segment = ShmSegment.from_fd(ring_fd, writable=True)  # owns ring_fd now
        except BaseException:
            os.close(self.doorbell)
            raise
        try:
            self.ring = PutRing(self.segment.array)
            if arena.array is None:
                raise ConnectionError("the arena was unmapped (the client is closing)")
            # the biggest batch worth a FLUSH that asks for its slots: what the ring can hold
            # and the daemon may grant (half the arena)
            self.max_batch = min(self.ring.grant_capacity, self.ring.capacity,
                                 len(arena.array) // 2)
        except BaseException:
            os.close(self.doorbell)
            self.segment.close()
            raise
        self.conn, self.arena = conn, arena
        self.grants: list[int] = []  # slots taken from the ring, not used yet
        self.refused = (0, -REFUSED_RETRY_S)  # (batch size, when): the last FLUSH that fell short
        self.unseen: set[bytes] = set()  # put, maybe not committed yet (EXISTS if put again)
        self.lock = threading.Lock()  # put_n, flush and close, one at a time
        self.closed = False  # (under the lock: a put never publishes into a closed ring)
        self.ended = False  # the daemon ended the channel (PutRing.ended): open another

    @classmethod
    def open(cls, conn: Connection, arena: ArenaMap) -> "DirectPuts":
        """Ask for a put channel on `conn` (a fresh local-socket connection it keeps)."""
        try:
            reply, fds = conn.call_fds(w.Puts(), 2)
            return cls(reply, fds, arena, conn)
        except BaseException:
            conn.close()
            raise

    def put_n(self, hashes: Sequence[bytes], rows) -> list[PutStatus] | None:
        """Put with no request, or None (nothing published) when there are not enough
        granted slots or ring room for this batch: use a request then. Blocks are copied into
        the slots granted so far while the drainer grants more; with a `conn`, one FLUSH asks
        for the slots still missing when none are left."""
        directory = self._directory()
        if directory is None:
            return None
        with self.lock:
            if not self._open():
                return None
            if len(hashes) == 1 and self.ring.room() and self._stocked():
                return self._put_one(hashes[0], rows, directory)
            new, seen, unseen = [], set(), self.unseen
            for i, h in enumerate(hashes):
                h = h if type(h) is bytes else w.hash_bytes(h)
                if len(h) != HASH_BYTES:
                    raise ValueError(f"block hashes are {HASH_BYTES} bytes each; hash {i} "
                                     f"of {len(hashes)} is {len(h)}")
                if h not in seen and h not in unseen and directory.find(h) is None:
                    new.append(i)
                seen.add(h)
            n = len(new)
            if not self._enough(n) and (self.conn is None or n > self.max_batch
                                        or self._was_refused(n)):
                return None  # no FLUSH to ask with, more than the daemon grants at once, or
                # a FLUSH as big fell short lately
            src = cpu_array(rows)
            src = rows if src is None else src
            slots: list[int] = []  # taken from the grants: given back unless published
            try:
                while len(slots) < n:
                    # what is granted now is copied into at once: the drainer commits the
                    # last put and grants the rest meanwhile (waiting for all of a big
                    # batch's slots put a FLUSH round trip before every 4 MiB x16 put)
                    got = self._take(n - len(slots)) if self.ring.room() >= n else []
                    if not got and not self._flush_for(n, len(slots)):
                        return None
                    slots += got
                    for i, slot in zip(new[len(slots) - len(got):], got):
                        copy_bytes(self.arena.array[slot], src[i], cold=True)
                self.ring.push([bytes(hashes[i]) for i in new], slots)
                slots = []  # published: the daemon's now
            finally:
                self.grants += slots  # copied into (or not), never published: still ours
            self.unseen.update(bytes(hashes[i]) for i in new)
            if new:
                self._ring_bell()
                if self._ended():
                    return None  # published after the daemon's last drain, maybe: by
                    # request (what that drain committed answers EXISTS there)
        stored = set(new)
        return [PutStatus.STORED if i in stored else PutStatus.EXISTS
                for i in range(len(hashes))]

    def put_one_at(self, block_hash: bytes, address: int) -> list[PutStatus] | None:
        """`put_n` of one block at `address` (a CPU tensor's: `host_address`; the caller
        keeps it alive) while a granted slot and ring room are in hand; None, and nothing
        published, when not: the caller puts it with rows then (`put_n` may ask for
        slots, or say to go by request)."""
        directory = self._directory()
        if directory is None:
            return None
        with self.lock:
            if self._open() and self.ring.room() and self._stocked():
                return self._put_one(block_hash, address, directory)
        return None

    def _directory(self):
        """The slot directory, or None once the daemon (or this namespace's store) is gone
        (then ask it anew, by request)."""
        directory = self.arena.directory
        if directory is None or directory.closed or not directory.writer_alive():
            return None
        return directory

    def _open(self) -> bool:
        """(Under the lock.) May a put publish into this channel? False once another
        thread ended it (its FLUSH failed), or the daemon did (it is stopping): by request
        then. Forgets the puts committed since the last look."""
        if self.closed or self._ended():
            return False
        if not self.ring.pending():
            self.unseen.clear()  # all committed: the slot directory shows them now
        return True

    def _put_one(self, block_hash: bytes, rows, directory) -> list[PutStatus]:
        """`put_n` of one block with a granted slot in hand and ring room (under the lock):
        the common same-host put, in as few steps as it takes (the general path's sets,
        lists and refill checks were ~5 us of a ~30 us 256 KiB put). `rows`: the block's
        host rows, or its address (`put_one_at`)."""
        h = block_hash if type(block_hash) is bytes else w.hash_bytes(block_hash)
        if len(h) != HASH_BYTES:
            raise ValueError(f"block hashes are {HASH_BYTES} bytes each, not {len(h)}")
        if h in self.unseen or directory.find(h) is not None:
            return [PutStatus.EXISTS]
        slot = self.grants.pop()
        try:
            arena = self.arena
            if type(rows) is int:
                held = arena.array  # (held while copying: close() unmaps no viewed mapping)
                if held is None:
                    raise ConnectionError("the arena was unmapped (the client is closing)")
                copy_at(arena.base + slot * arena.block_bytes, rows, arena.block_bytes,
                        cold=True)
            else:
                src = cpu_array(rows)
                copy_bytes(arena.array[slot], (rows if src is None else src)[0], cold=True)
            self.ring.push_one(h, slot)
        except BaseException:
            self.grants.append(slot)  # never published: still ours
            raise
        self.unseen.add(h)
        self._ring_bell()
        if self._ended():
            return None  # (as put_n's)
        return [PutStatus.STORED]

    def _ring_bell(self) -> None:
        """Wake the drainer for the records just published, unless its pass over this ring
        is under way and will see them (PutRing.asleep). The fence keeps the write index's
        store ahead of the looks that follow, this one and the caller's at the ring's end
        (see PutRing.mark_ended); without it, the eventfd's own lock serves, rung each time."""
        if fence is not None:
            fence()
            if not self.ring.asleep():
                return
        os.eventfd_write(self.doorbell, 1)

    def _ended(self) -> bool:
        """Has the daemon ended this channel? Then nothing more is published into it."""
        if not self.ended and self.ring.ended():
            self.ended = True
        return self.ended

    def _take(self, n: int) -> list[int]:
        """Up to n granted slots, as many as are granted now."""
        self._refill(n)
        return [self.grants.pop() for _ in range(min(n, len(self.grants)))]

    def _stocked(self) -> bool:
        """A granted slot in hand, taking what the drainer granted since the last take when
        none is (a single put that ran out went the batch path for it: ~240 us quiet, one
        put in ~170 back to back, and ~4 ms under two busy processes)."""
        if not self.grants:
            self._refill(1)
        return bool(self.grants)

    def _refill(self, n: int) -> None:
        """Fewer than n slots in hand: take every grant the ring holds."""
        if len(self.grants) < n:
            self.grants += self.ring.take_grants(self.ring.grant_capacity)

    def _flush_for(self, n: int, held: int) -> bool:
        """One FLUSH for a batch of n, `held` of whose slots are in hand: the daemon's
        drainer is behind (a busy host), or the batch is bigger than the stock of grants:
        it commits what waits and grants the rest, cheaper than a put request (a reserve
        and a commit). False when it could not (nothing asked: no `conn`, or a FLUSH as big
        fell short lately)."""
        if self.conn is None or self._was_refused(n):
            return False
        self.conn.call(w.Flush(want=n))
        if self._enough(n - held) and self.ring.room() >= n:
            return True
        self.refused = (n, time.monotonic())
        return False

    def _was_refused(self, n: int) -> bool:
        """Did a FLUSH fall short for a batch this big lately? (Other writers hold the
        grants: ask again only after REFUSED_RETRY_S, not a wasted round trip per put.)"""
        size, at = self.refused
        return n >= size and time.monotonic() - at < REFUSED_RETRY_S

    def _enough(self, n: int) -> bool:
        """Are there n granted slots and n ring entries free (taking what the ring has)?"""
        self._refill(n)
        return len(self.grants) >= n and self.ring.room() >= n

    def pending(self) -> bool:
        """Are puts published that the daemon has not committed yet? (Not in a channel the
        daemon ended: its last drain committed all it will, and no FLUSH can be answered.)"""
        return not self.closed and not self._ended() and bool(self.ring.pending())

    def flush(self) -> None:
        """Every put so far is committed (visible to any request) when this returns."""
        if not self.pending():
            return  # nothing waits: a put that returned before this call has published
        with self.lock:
            if self.pending():  # (not in a channel the daemon ended: nothing answers)
                self.conn.call(w.Flush())

    def forget(self) -> None:
        """In a child made by os.fork(): the ring, doorbell and connection are the parent's
        channel: only this process's copies go, with nothing published, rung or sent (and
        no lock taken: a parent's thread that held it does not exist here)."""
        self.closed = self.ended = True
        self.lock = threading.Lock()
        try:
            if self.conn is not None:
                self.conn.close()
        finally:
            try:
                os.close(self.doorbell)
            finally:
                self.segment.close()

    def close(self, flush: bool = True) -> None:
        """Flush (unless `flush` is False: the channel failed), then end the channel (the
        daemon commits what the ring holds and takes back the slots still granted). Under
        the lock: closed under a put in another thread, the ring and doorbell went while it
        published (a STORED block lost, 8 bytes rung into whatever reused the doorbell's
        number). Without a `conn`, the caller flushes and closes its connection first."""
        with self.lock:
            if self.closed:
                return
            try:
                if self.conn is not None and flush and self.pending():
                    self.conn.call(w.Flush())
            finally:
                self.closed = True
                if self.conn is not None:
                    self.conn.close()
                os.close(self.doorbell)
                self.segment.close()
