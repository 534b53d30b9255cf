"""The DRAM arena's layout, shared by the daemon (which creates it, `tiers.dram`) and its
same-host clients (which map it from a descriptor, `client.shm`): one anonymous
shared-memory segment, a metadata page, then the slots back to back.

    meta (4096 B)   magic "KVTSHM02" | num_slots u64 | slot_bytes u64 | arena id (16 B)
    slots           num_slots x slot_bytes

The arena id is random per arena; HELLO announces it, so a client checks that the memory
it was handed is the arena of the daemon it authenticated with. Which slot holds which
block is in the slot directory beside it (`kvstore.slotdir`).
"""
from __future__ import annotations

import struct

from kvstore.errors import ConfigError, StoreClosedError
from transfer.shm import ShmSegment

_META = struct.Struct("<8sQQ16s")
_META_MAGIC = b"KVTSHM02"
META_BYTES = 4096
ARENA_ID_BYTES = 16


def write_meta(buf, num_slots: int, slot_bytes: int, arena_id: bytes) -> None:
    _META.pack_into(buf, 0, _META_MAGIC, num_slots, slot_bytes, arena_id)


def arena_meta(view) -> tuple[int, int, bytes]:
    """(num_slots, slot_bytes, arena id) of a mapped arena's first page."""
    magic, num_slots, slot_bytes, arena_id = _META.unpack_from(view, 0)
    if magic != _META_MAGIC or len(view) < META_BYTES + num_slots * slot_bytes:
        raise ConfigError("that shared memory is not a kvtier DRAM arena")
    return num_slots, slot_bytes, arena_id


class DramArenaReader:
    """Maps a DRAM arena from a descriptor another process shared (read-only), to copy
    slots it holds leases on. Takes ownership of `fd`."""

    def __init__(self, fd: int) -> None:
        self._seg = ShmSegment.from_fd(fd, writable=False)
        try:
            self.num_slots, self.slot_bytes, self.arena_id = arena_meta(self._seg.array)
        except ConfigError:
            self._seg.close()
            raise
        self._closed = False

    def read_into(self, slot: int, dst) -> None:
        """Copy slot `slot` into the writable buffer `dst` (slot_bytes long)."""
        if self._closed:
            raise StoreClosedError("DRAM arena reader is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        start = META_BYTES + slot * self.slot_bytes
        memoryview(dst).cast("B")[:] = self._seg.array[start:start + self.slot_bytes].data

    def read(self, slot: int) -> bytes:
        out = bytearray(self.slot_bytes)
        self.read_into(slot, out)
        return bytes(out)

    def close(self) -> None:
        self._closed = True
        self._seg.close()
