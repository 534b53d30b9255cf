"""The same-host path: map the daemon's DRAM arena file once and copy slots directly.

The daemon reports its arena's path and (st_dev, st_ino); the client is on the same host
exactly when it can open that path and finds the same file there. The mapping is made once
(pre-faulted, via the transfer layer's `map_path`) and reused for every request. Where the
daemon also reports the arena's slot directory (and the CPU orders memory as x86-64 does),
reads of DRAM blocks need no request at all: see `kvstore.tiers.slotdir`.
"""
from __future__ import annotations

import os

import torch

from kvstore import wire as w
from kvstore.errors import ConfigError
from kvstore.tiers.dram import META_BYTES
from kvstore.tiers.slotdir import DIRECT_READS, SlotDirectoryReader
from transfer.shm import map_path


class ArenaMap:
    def __init__(self, info: w.HelloOk) -> None:
        self.key = (info.shm_path, info.shm_dev, info.shm_ino)
        nbytes = info.shm_slots * info.block_bytes
        self._mm, view = map_path(info.shm_path, nbytes, META_BYTES)
        self.array = view[:nbytes].reshape(info.shm_slots, info.block_bytes)  # numpy rows
        self.rows = torch.from_numpy(self.array)
        self.directory: SlotDirectoryReader | None = None
        if DIRECT_READS and info.shm_dir:
            try:
                self.directory = SlotDirectoryReader(info.shm_dir, info.shm_slots)
            except (OSError, ConfigError):
                pass  # leased reads (one round trip each) still work

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        self.rows = self.array = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a copy in another thread still holds a view; unmapped when it is dropped


def same_host_arena(info: w.HelloOk) -> ArenaMap | None:
    """A mapping of the daemon's arena when this process can see it, else None (use TCP)."""
    if not info.shm_path:
        return None
    try:
        st = os.stat(info.shm_path)
    except OSError:
        return None
    if (st.st_dev, st.st_ino) != (info.shm_dev, info.shm_ino):
        return None
    try:
        return ArenaMap(info)
    except (OSError, ValueError):
        return None  # e.g. no permission to map it: the TCP path still works
