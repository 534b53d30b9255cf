"""The same-host path: the daemon's DRAM arena, mapped once, and slots copied directly.

A client on the daemon's host reaches it over the daemon's local Unix socket (its abstract
name comes in HELLO's reply, only after the token check) and asks for the namespace's arena
with SHARE: the reply carries two descriptors, the arena (read-write: the client writes the
slots RESERVE gives it) and its slot directory (read-only, sealed). Nothing has a name in a
filesystem, so no other process can map them; any uid can use the path. The arena's first
page holds its random id, which must match the one HELLO announced (the descriptors come
from the daemon we authenticated with). Where the directory is mapped (and the CPU orders
memory as x86-64 does), reads of DRAM blocks need no request at all: see
`kvstore.tiers.slotdir`.
"""
from __future__ import annotations

import torch

from kvstore import wire as w
from kvstore.errors import ConfigError
from kvstore.tiers.dram import META_BYTES, arena_meta
from kvstore.tiers.slotdir import DIRECT_READS, SlotDirectoryReader
from transfer.shm import ShmSegment


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
        self.rows = torch.from_numpy(self.array)
        self.directory: SlotDirectoryReader | None = None
        if DIRECT_READS:
            try:
                self.directory = SlotDirectoryReader(dir_fd, num_slots)
            except (OSError, ConfigError):
                pass  # leased reads (one round trip each) still work
        else:
            w.close_fds([dir_fd])

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        self.rows = self.array = None
        self._seg.close()  # a copy in another thread may still hold a view: unmapped after


def map_arena(conn, block_bytes: int) -> ArenaMap | None:
    """Ask the daemon (over `conn`, a local-socket connection) for the namespace's arena;
    None when it has no DRAM tier."""
    if not conn.info.arena_id:
        return None
    reply, (arena_fd, dir_fd) = conn.call_fds(w.Share(), 2)
    return ArenaMap(reply, arena_fd, dir_fd, block_bytes)
