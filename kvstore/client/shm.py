"""The same-host path: the daemon's DRAM arena, mapped once, and slots copied directly.

A client on the daemon's host reaches it over the daemon's local Unix socket (its abstract
name comes in HELLO's reply, only after the token check) and asks for the namespace's arena
with SHARE: the reply carries two descriptors, the arena (read-write: the client writes the
slots RESERVE gives it) and its slot directory (read-only, sealed). Nothing has a name in a
filesystem, so no other process can map them; any uid can use the path. The arena's first
page holds its random id, which must match the one HELLO announced (the descriptors come
from the daemon we authenticated with). Where the directory is mapped (and the CPU orders
memory as x86-64 does), reads of DRAM blocks need no request at all: see
`kvstore.slotdir`.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from kvstore import wire as w
from kvstore.buffers import cpu_array
from kvstore.errors import ConfigError, KVStoreError
from kvstore.events import TierKind
from kvstore.arena_layout import META_BYTES, arena_meta
from kvstore.slotdir import DIRECT_READS, SlotDirectoryReader
from transfer.copy import copy_bytes, memmove
from transfer.shm import ShmSegment

log = logging.getLogger("kvtier.client")

_DRAM = TierKind.DRAM  # a module global: an enum member's lookup cost ~1 us a read
VECTOR_READS = 32  # direct reads of more blocks take the vectorised path (measured: even
# with a per-block loop up to ~64 blocks, ahead at 128 blocks of 64 KiB)


class ArenaMap:
    """One mapping of a namespace's arena (and its slot directory) for a client's life."""

    def __init__(self, info: w.ShareOk, arena_fd: int, dir_fd: int, block_bytes: int) -> None:
        try:
            self._seg = ShmSegment.from_fd(arena_fd, writable=True)
        except BaseException:
            w.close_fds([dir_fd])
            raise
        try:
            num_slots, slot_bytes, arena_id = arena_meta(self._seg.array)
            if (arena_id, num_slots, slot_bytes) != (info.arena_id, info.num_slots, block_bytes):
                raise ConfigError("the shared arena is not the one the daemon announced")
        except BaseException:
            self._seg.close()
            w.close_fds([dir_fd])
            raise
        self.arena_id = arena_id
        nbytes = num_slots * block_bytes
        self.array = self._seg.array[META_BYTES:META_BYTES + nbytes].reshape(num_slots,
                                                                            block_bytes)
        self.rows = self.array  # (rows of host memory: numpy, as every host buffer here)
        self.block_bytes = block_bytes
        self.base = self.array.ctypes.data  # slot i at base + i * block_bytes
        self.directory: SlotDirectoryReader | None = None
        if DIRECT_READS:
            try:
                self.directory = SlotDirectoryReader(dir_fd, num_slots)
            except (OSError, ConfigError):
                pass  # leased reads (one round trip each) still work
        else:
            w.close_fds([dir_fd])

    def read_direct(self, hashes: Sequence[bytes], rows, prefix: bool = False
                    ) -> tuple[list[TierKind | None], list[int], list[bytes]]:
        """Copy every block the slot directory shows in a DRAM slot (with `prefix`: up to
        the first that it does not), with no request: (tiers, indices left for the daemon,
        the hashes copied, for the next TOUCH). `rows` is the destination rows, or the
        address of n blocks back to back in host memory (`host_address`: at most
        VECTOR_READS blocks). Each copy is kept only if its slot's generation did not move
        meanwhile."""
        at = rows if type(rows) is int else None
        dst = None if at is not None else cpu_array(rows)
        if at is None and len(hashes) > VECTOR_READS:
            return self._read_direct_n(hashes, rows, dst, prefix)
        arr, d = self.array, self.directory  # `arr` held: close() leaves a viewed mapping
        n = len(hashes)
        if arr is None or d is None:
            return [None] * n, list(range(n)), []
        base, bb = self.base, self.block_bytes
        tiers: list[TierKind | None] = [None] * n
        missed, touched = [], []
        for i, h in enumerate(hashes):
            h = h if type(h) is bytes else w.hash_bytes(h)
            found = None if prefix and missed else d.find(h)
            if found is None:
                missed.append(i)
                continue
            slot, gen = found
            # by address, no view of either side made: views and a tensor's numpy
            # conversion were ~a fifth of a 1 MiB read
            if at is not None:
                memmove(at + i * bb, base + slot * bb, bb)
            elif dst is not None:
                np.copyto(dst[i], arr[slot])
            else:
                copy_bytes(rows[i], self.rows[slot])
            if d.still_valid(slot, gen):
                tiers[i] = _DRAM
                touched.append(h)
            else:
                missed.append(i)  # the slot was reused while we copied: ask the daemon
        return tiers, missed, touched

    def _read_direct_n(self, hashes, rows, dst: np.ndarray | None, prefix: bool):
        """`read_direct` for a batch: one vectorised directory lookup, one gather copy into
        a single destination buffer, one generation check."""
        d = self.directory
        packed = w.pack_hashes(hashes)
        slots, gens = d.find_n(packed)
        if prefix:
            slots[_first_false(slots >= 0):] = -1
        found = np.flatnonzero(slots >= 0)
        if dst is not None and len(found) == len(hashes):
            # mode="clip": slots are in range already; the default "raise" buffers `out`
            # and ran at a third of the speed
            np.take(self.array, slots, axis=0, out=dst, mode="clip")
        else:
            for i in found.tolist():
                copy_bytes(rows[i], self.rows[int(slots[i])])
        ok = np.zeros(len(hashes), bool)
        ok[found] = d.still_valid_n(slots[found], gens[found])
        if prefix:
            ok[_first_false(ok):] = False
        tiers: list[TierKind | None] = [TierKind.DRAM if k else None for k in ok.tolist()]
        hit = np.flatnonzero(ok).tolist()
        return tiers, np.flatnonzero(~ok).tolist(), [packed[16 * i:16 * i + 16] for i in hit]

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        self.rows = self.array = None
        self._seg.close()  # a copy in another thread may still hold a view: unmapped after


def _first_false(mask: np.ndarray) -> int:
    """Index of the first False in a bool array (its length when there is none)."""
    off = np.flatnonzero(~mask)
    return int(off[0]) if off.size else len(mask)


def map_arena(conn, block_bytes: int) -> ArenaMap | None:
    """Ask the daemon (over `conn`, a local-socket connection) for the namespace's arena;
    None when it has no DRAM tier, or will not pass its descriptors now (then blocks go
    inline over the local socket: the client works all the same)."""
    if not conn.info.arena_id:
        return None
    try:
        reply, (arena_fd, dir_fd) = conn.call_fds(w.Share(), 2)
    except w.RemoteError as e:
        if e.code not in SHARE_REFUSALS:
            raise
        log.warning("the daemon did not share its memory (%s): blocks go inline over the "
                    "local socket", e)
        return None
    return open_arena(reply, arena_fd, dir_fd, block_bytes)


SHARE_REFUSALS = (w.ErrorCode.UNAVAILABLE, w.ErrorCode.QUOTA)  # a SHARE the client lives without


def open_arena(info: w.ShareOk, arena_fd: int, dir_fd: int, block_bytes: int) -> ArenaMap | None:
    """`ArenaMap` of SHARE's descriptors, or None (blocks then go inline over the local
    socket, as over TCP) when the system will not map them (a segment another process
    sealed against writable mappings, no address space left) or they do not hold an arena
    of this namespace (its layout header overwritten: any same-host client of the
    namespace can write the arena, and one that did so stopped every new client of it)."""
    try:
        return ArenaMap(info, arena_fd, dir_fd, block_bytes)
    except (OSError, ValueError, KVStoreError) as e:
        log.warning("cannot map the daemon's shared memory (%s): blocks go inline over the "
                    "local socket", e)
        return None
