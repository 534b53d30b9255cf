"""Same-host puts with no request: a client writes blocks into DRAM slots the daemon granted
it in advance, then appends (hash, slot) commit records to a ring both share.

One ring per put channel (a local-socket connection of one client), in anonymous shared
memory the daemon creates and hands over with the channel (`kvstore.daemon.putchannel`):

    header (128 B)       u64 x 16: magic, capacity, commit write, commit read,
                         grant write, grant read, grant capacity, closed, asleep, 7 unused
    commits[capacity]    16-byte block hash + int64 slot   (client writes, daemon reads)
    grants[gcapacity]    int64 slot                        (daemon writes, client reads)

Single producer, single consumer on each ring: the writer fills entries, then advances its
index; the reader reads the index, then the entries, then advances its own. x86-64 keeps
stores in program order and loads in program order (TSO), which is all this needs; other
CPUs keep the request paths (`DIRECT_PUTS` is False there). A client wakes the daemon with
an eventfd after a batch, only while the ring is marked asleep (`asleep`): the drainer
clears the mark when it starts a pass over the ring and sets it again once it finds no
more records, looking once more after setting it. Each side puts a full fence between its
store and its load (`fence`), so either the client sees the mark and rings, or the drainer
sees its record. Puts back to back then ring once per drainer pass, not once per put (a
ring woke the drainer, a thread competing with the putter's, for every block). Nothing
waits for the commit. The daemon checks every record's
slot against what it granted that channel, so a confused or hostile client can only waste
its own grants.
"""
from __future__ import annotations

import struct

import numpy as np

from kvstore.slotdir import DIRECT_READS

MAGIC = 0x4B56545055545232  # "KVTPUTR2" ('...RG', the first layout, had no `asleep` word)
HEADER_WORDS = 16
M, CAP, CW, CR, GW, GR, GCAP, CLOSED, ASLEEP = range(9)
try:
    from transfer._stream import fence
except ImportError:  # no C compiler at install: the client rings after every publish
    fence = None
RECORD = np.dtype([("hash", "V16"), ("slot", "<i8")])
DIRECT_PUTS = DIRECT_READS  # the same memory-ordering assumption as the slot directory
_SLOT = struct.Struct("<q")
FEW_RECORDS = 8  # `peek` reads this many records or fewer from the bytes, not through numpy:
# the drainer's peek of one record took ~31 us of CPU, run cold after an idle spell (an
# arange, a fancy index of the record array and two conversions)


def ring_bytes(capacity: int, grant_capacity: int) -> int:
    return 8 * HEADER_WORDS + RECORD.itemsize * capacity + 8 * grant_capacity


class PutRing:
    """Views over one ring's shared memory (a uint8 numpy array)."""

    def __init__(self, buf: np.ndarray, capacity: int | None = None,
                 grant_capacity: int | None = None) -> None:
        # a memoryview: indexing one word costs ~0.1 us (a numpy scalar ~1 us)
        self.head = memoryview(buf[:8 * HEADER_WORDS]).cast("Q")
        if capacity is not None:  # the creator lays it out
            for k in range(HEADER_WORDS):
                self.head[k] = 0
            self.head[CAP], self.head[GCAP] = capacity, grant_capacity
            self.head[ASLEEP] = 1  # (no drainer pass looks at it until its bell rings)
            self.head[M] = MAGIC
        if self.head[M] != MAGIC:
            raise ValueError("not a kvtier put ring")
        cap, gcap = int(self.head[CAP]), int(self.head[GCAP])
        if buf.nbytes < ring_bytes(cap, gcap):
            raise ValueError("put ring shorter than its header says")
        off = 8 * HEADER_WORDS
        self._commit_bytes = memoryview(buf[off:off + RECORD.itemsize * cap])
        self.commits = buf[off:off + RECORD.itemsize * cap].view(RECORD)
        off += RECORD.itemsize * cap
        self.grants = buf[off:off + 8 * gcap].view("<i8")
        self.capacity, self.grant_capacity = cap, gcap
        # the creator's (daemon's) own indices: the client can write the shared header, so
        # the daemon never reads back what it owns, and clamps what the client owns
        self._creator = capacity is not None
        self._cr, self._gw = int(self.head[CR]), int(self.head[GW])

    # ---------------------------------------------------------------- client side

    def room(self) -> int:
        """Commit records the client may append now."""
        return self.capacity - int(self.head[CW] - self.head[CR])

    def push(self, hashes: list[bytes], slots: list[int]) -> None:
        """Append commit records (the caller checked `room`), then publish them."""
        w, size = int(self.head[CW]), RECORD.itemsize
        for k, (h, slot) in enumerate(zip(hashes, slots)):
            at = ((w + k) % self.capacity) * size
            self._commit_bytes[at:at + size] = bytes(h) + _SLOT.pack(slot)
        self.head[CW] = w + len(slots)  # after the records: the daemon sees them whole

    def push_one(self, block_hash: bytes, slot: int) -> None:
        """`push` of one record (a 16-byte hash)."""
        w, size = int(self.head[CW]), RECORD.itemsize
        at = (w % self.capacity) * size
        self._commit_bytes[at:at + size] = block_hash + _SLOT.pack(slot)
        self.head[CW] = w + 1  # after the record: the daemon sees it whole

    def pending(self) -> int:
        """Commit records the daemon has not taken yet."""
        return int(self.head[CW] - self.head[CR])

    def asleep(self) -> bool:
        """Must a client ring the doorbell for what it just published? (After `fence`.)"""
        return bool(self.head[ASLEEP])

    def ended(self) -> bool:
        """Has the daemon ended this channel (`mark_ended`)? A record published before the
        daemon marked it is committed by its last drain; one published after may never be:
        a client that sees the mark after publishing puts those blocks again by request."""
        return bool(self.head[CLOSED])

    def take_grants(self, n: int) -> list[int]:
        """Up to n granted slots."""
        r, w = int(self.head[GR]), int(self.head[GW])
        k = min(n, w - r)
        out = self.grants[np.arange(r, r + k) % self.grant_capacity].tolist() if k else []
        self.head[GR] = r + k
        return out

    # ---------------------------------------------------------------- daemon side

    def peek(self) -> tuple[list[bytes], list[int]]:
        """Every published commit record, oldest first, left in the ring: `consume` them
        once committed, so that `pending` stays non-zero until the slot directory shows
        them (the client's EXISTS answer for a block put twice rests on that). A write
        index the client moved back or too far reads as nothing or a full ring."""
        r, w = self._cr, int(self.head[CW])
        n = max(0, min(w - r, self.capacity))
        if n <= FEW_RECORDS:  # (most drains: a put or two since the last) read as bytes
            size, buf, cap = RECORD.itemsize, self._commit_bytes, self.capacity
            ats = [(k % cap) * size for k in range(r, r + n)]
            return [bytes(buf[at:at + 16]) for at in ats], \
                [_SLOT.unpack_from(buf, at + 16)[0] for at in ats]
        recs = self.commits[np.arange(r, r + n) % self.capacity]
        return [bytes(v) for v in recs["hash"]], recs["slot"].tolist()

    def waiting(self) -> int:
        """(Daemon side.) Published records not consumed yet, by the daemon's own read
        index: within 0..capacity whatever the client wrote."""
        return max(0, min(int(self.head[CW]) - self._cr, self.capacity))

    def mark_asleep(self, asleep: bool) -> None:
        """(Daemon side.) Whether the client must ring for its next record (`asleep`)."""
        self.head[ASLEEP] = int(asleep)

    def mark_ended(self) -> None:
        """The daemon's last drain follows (`ended`). The mark is stored before that drain
        reads the client's write index, and the client reads it after storing its index:
        on x86-64 a store may pass a later load, so both sides put a barrier between (the
        daemon takes the channel's lock, a locked instruction; the client runs `fence`, or
        without it rings its eventfd, whose kernel side takes a spinlock): then either the
        drain sees the client's records or the client sees the mark."""
        self.head[CLOSED] = 1

    def consume(self, n: int) -> None:
        """The n oldest records are committed: their ring entries are free again."""
        self._cr += n
        self.head[CR] = self._cr

    def _grant_write(self) -> int:
        """The grant write index: the daemon's own copy on its side, the header's on the
        client's (which only reads it)."""
        return self._gw if self._creator else int(self.head[GW])

    def _grants_out(self) -> int:
        """Grants pushed and not taken: by the client's read index, held within 0..capacity."""
        return min(max(self._grant_write() - int(self.head[GR]), 0), self.grant_capacity)

    def grant_room(self) -> int:
        return self.grant_capacity - self._grants_out()

    def push_grants(self, slots: list[int]) -> None:
        w = self._gw
        for k, slot in enumerate(slots):
            self.grants[(w + k) % self.grant_capacity] = slot
        self._gw = w + len(slots)
        self.head[GW] = self._gw

    def unclaimed_grants(self) -> list[int]:
        """Granted slots the client has not taken (given back when the channel ends)."""
        w = self._grant_write()
        return [int(self.grants[i % self.grant_capacity]) for i in range(w - self._grants_out(), w)]
