"""POSIX shared memory and file mappings, pre-faulted once (first touch is ~10× slower).

Not `multiprocessing.shared_memory`: on Python 3.11 its resource tracker unlinks segments
that a process merely attached to. Here only the creator unlinks.
"""
from __future__ import annotations

import mmap
import os
import uuid

import numpy as np

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def _prefault(mm: mmap.mmap, view: np.ndarray) -> None:
    """Fault every page in once (writable), so the hot path never takes a first touch.

    MADV_POPULATE_WRITE does it without touching contents, so it is safe on a mapping that a
    peer is writing to; the fallback (older kernels) only reads.
    """
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        int(view[::PAGE].sum(dtype=np.uint64))


def map_path(path: str, size: int, offset: int = 0, writable: bool = True,
             prefault: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    """Map `size` bytes of `path` starting at `offset`; return (mmap, uint8 view of the range)."""
    base = offset - offset % PAGE
    flags = os.O_RDWR if writable else os.O_RDONLY
    fd = os.open(path, flags)
    try:
        mm = mmap.mmap(fd, size + (offset - base), mmap.MAP_SHARED,
                       mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0), offset=base)
    finally:
        os.close(fd)
    view = np.frombuffer(mm, dtype=np.uint8)[offset - base:]
    if prefault and size:
        _prefault(mm, view)
    return mm, view


class ShmSegment:
    """A named POSIX shared-memory segment, mapped once. The creator owns (unlinks) it."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, view: np.ndarray, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self._mm = mm
        self.array = view  # uint8, length `size`

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, size: int, name: str | None = None) -> "ShmSegment":
        if size <= 0:
            raise ValueError(f"shm segment size must be > 0, got {size}")
        name = name or f"kvt-{uuid.uuid4().hex[:16]}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        mm, view = map_path(path, size)
        return cls(name, size, mm, view, owner=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "ShmSegment":
        mm, view = map_path(os.path.join(SHM_DIR, name), size)
        return cls(name, size, mm, view, owner=False)

    def close(self) -> None:
        """Unmap (best effort while numpy views are alive) and, if the creator, unlink."""
        self.array = np.empty(0, dtype=np.uint8)
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.owner = False
        try:
            self._mm.close()
        except BufferError:
            pass  # views still exported; the mapping goes when they do

    def __enter__(self) -> "ShmSegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
