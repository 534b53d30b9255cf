"""Shared memory: named POSIX segments and anonymous ones (memfd), mapped once, pre-faulted.

Two kinds of `ShmSegment`:
- named (`create` / `attach`): a /dev/shm file that same-host peers map by path. The
  transfer layer's shm backend uses these between agents that trust each other.
- anonymous (`anonymous` / `from_fd`): a memfd with no name in any filesystem. Nobody can
  list or open it; another process reaches it only when it is handed a file descriptor
  (`share_fd`, sent over a Unix-domain socket with SCM_RIGHTS), read-only where the
  receiver only reads. It vanishes with the last mapping or descriptor, so a killed
  process leaves nothing behind. Its size is sealed (a holder of a writable descriptor
  cannot shrink it under the owner, which would SIGBUS the owner), and `seal_writes`
  stops any new writable mapping while the owner's own one keeps working.

Not `multiprocessing.shared_memory`: on Python 3.11 its resource tracker unlinks segments
that a process merely attached to. Here only the creator unlinks.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import uuid

import numpy as np

try:
    from transfer._stream import populate as _populate
except ImportError:  # built without a C compiler (or before it had populate): mmap.madvise,
    _populate = None  # the GIL held

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
F_SEAL_FUTURE_WRITE = 0x0010  # Linux >= 5.1; not in Python 3.11's fcntl
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)


HUGE_PAGE = 2 << 20


def _huge_pages(mm: mmap.mmap, size: int) -> None:
    """Ask for transparent huge pages on a big mapping, before it is faulted in. Shared
    memory gets them only where the host allows it (`shmem_enabled` set to `advise`,
    `within_size` or `always` under /sys/kernel/mm/transparent_hugepage); elsewhere this
    changes nothing. With 4 KiB pages a copy into the arena ran at ~0.65x a copy into
    private memory that has huge pages (TLB misses), measured on a host set to `never`."""
    if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


def _prefault(mm: mmap.mmap, view: np.ndarray, writable: bool) -> None:
    """Fault every page in once, so the hot path never takes a first touch (~10x slower).

    MADV_POPULATE_* does it without touching contents, so it is safe on a mapping a peer is
    writing to; the fallback (older kernels) only reads. With transfer._stream the madvise
    runs with the GIL released (mmap.madvise keeps it: a daemon making a namespace's 1 GiB
    arena stood still for ~0.5 s, every tenant's requests with it).
    """
    try:
        if _populate is not None:
            _populate(mm, writable)
        else:
            mm.madvise(MADV_POPULATE_WRITE if writable else MADV_POPULATE_READ)
    except (OSError, ValueError):
        int(view[::PAGE].sum(dtype=np.uint64))


def map_fd(fd: int, size: int, offset: int = 0, writable: bool = True,
           prefault: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    """Map `size` bytes of an open file from `offset`; (mmap, uint8 view of the range).
    The mapping keeps its own reference: the caller may close `fd` afterwards."""
    base = offset - offset % PAGE
    mm = mmap.mmap(fd, size + (offset - base), mmap.MAP_SHARED,
                   mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0), offset=base)
    view = np.frombuffer(mm, dtype=np.uint8)[offset - base:]
    _huge_pages(mm, size)
    if not writable:
        view.flags.writeable = False
    if prefault and size:
        _prefault(mm, view, writable)
    return mm, view


def map_path(path: str, size: int, offset: int = 0, writable: bool = True,
             prefault: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    """Map `size` bytes of `path` starting at `offset`; return (mmap, uint8 view of the range)."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return map_fd(fd, size, offset, writable, prefault)
    finally:
        os.close(fd)


class ShmSegment:
    """A shared-memory segment mapped once. The creator owns it (unlinks a named one)."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, view: np.ndarray, owner: bool,
                 fd: int | None = None) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self.fd = fd  # anonymous segments: the creator's descriptor (None once closed)
        self._mm = mm
        self.array = view  # uint8, length `size`

    @property
    def path(self) -> str | None:
        """Where same-host peers map a named segment; None for an anonymous one."""
        return None if self.name is None else os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, size: int, name: str | None = None) -> "ShmSegment":
        if size <= 0:
            raise ValueError(f"shm segment size must be > 0, got {size}")
        name = name or f"kvt-{uuid.uuid4().hex[:16]}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm, view = map_fd(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, size, mm, view, owner=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "ShmSegment":
        mm, view = map_path(os.path.join(SHM_DIR, name), size)
        return cls(name, size, mm, view, owner=False)

    @classmethod
    def anonymous(cls, size: int, label: str = "kvtier", prefault: bool = True,
                  final: bool = True) -> "ShmSegment":
        """A memfd of `size` bytes, mapped writable, its size sealed. `label` only names it
        in /proc/PID/maps. Reach it from another process with `share_fd` + `from_fd`.
        `final`: the seals too (F_SEAL_SEAL), else they are sealed by `seal_writes`. Open,
        anyone holding a descriptor could add F_SEAL_FUTURE_WRITE, and no later client
        could map the segment writable again (a same-host client breaking its namespace's
        arena for every other client of it)."""
        if size <= 0:
            raise ValueError(f"shm segment size must be > 0, got {size}")
        fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | (F_SEAL_SEAL if final else 0))
            mm, view = map_fd(fd, size, prefault=prefault)
        except BaseException:
            os.close(fd)
            raise
        return cls(None, size, mm, view, owner=True, fd=fd)

    @classmethod
    def from_fd(cls, fd: int, writable: bool, offset: int = 0,
                size: int | None = None) -> "ShmSegment":
        """Map a descriptor another process handed us (its whole size from `offset`, or
        `size` bytes). Takes ownership of `fd`: it is closed once mapped."""
        try:
            total = os.fstat(fd).st_size
            size = total - offset if size is None else size
            if size <= 0 or offset + size > total:
                raise ValueError(f"shared memory of {total} bytes has no {size} bytes "
                                 f"at offset {offset}")
            mm, view = map_fd(fd, size, offset, writable)
        finally:
            os.close(fd)
        return cls(None, size, mm, view, owner=False)

    def seal_writes(self) -> None:
        """No new writable mapping or write(2) from anyone, ever; ours keeps working. The
        seals are final then (of a segment made with `final=False`)."""
        fcntl.fcntl(self.fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SEAL)

    def share_fd(self, writable: bool) -> int:
        """A new descriptor (its own open file description) of this anonymous segment, to
        send to another process and then close. Read-only unless `writable`. Being a
        separate description, it never shares the owner's flock."""
        assert self.fd is not None, "only the creator of an anonymous segment shares it"
        return os.open(f"/proc/self/fd/{self.fd}",
                       (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)

    def close(self) -> None:
        """Unmap (best effort while numpy views are alive) and, if the creator, unlink."""
        self.array = np.empty(0, dtype=np.uint8)
        if self.owner and self.name is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.owner = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self._mm.close()
        except BufferError:
            pass  # views still exported; the mapping goes when they do

    def __enter__(self) -> "ShmSegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
