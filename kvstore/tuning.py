"""Process-wide tuning for a process that moves many MiB-sized blocks (the daemon, benches).

glibc serves every allocation of 128 KiB or more with a fresh mmap and unmaps it on free, so
each block-sized bytes object RocksDB hands back is first-touched page by page (~10x slower
than a warm copy here). Raising the mmap and trim thresholds keeps freed block buffers in
the heap for the next one. The cost: the process keeps its peak heap instead of returning
it to the OS. A library must not do this behind its caller's back, so it is opt-in.
"""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc_for_large_blocks(max_block_bytes: int = 64 << 20) -> bool:
    """Returns False where the C library is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, max_block_bytes)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, 4 * max_block_bytes))
