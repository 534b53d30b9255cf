"""DRAM tier: a fixed-slot arena in POSIX shared memory (`/dev/shm/<name>`).

The segment starts with one 4 KiB page describing it (magic, num_slots, slot_bytes), then
the slots. Another process on the host maps it by name (`DramArenaReader`) and copies a
slot it holds a lease on with no socket in between. The arena is pre-faulted at creation
(first-touch faults on /dev/shm cost ~10x a warm copy) and, where a GPU exists, registered
with CUDA as pinned memory so device copies run at full speed.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
import time
import weakref

import torch

from kvstore.errors import ConfigError, StoreClosedError
from kvstore.events import TierKind
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.slotdir import SlotDirectory, dir_path

SHM_DIR = "/dev/shm"
_META = struct.Struct("<8sQQ")
_META_MAGIC = b"KVTSHM01"
META_BYTES = 4096


def shm_path(name: str) -> str:
    if not name or "/" in name:
        raise ConfigError(f"shared-memory name {name!r} must be a non-empty name without '/'")
    return os.path.join(SHM_DIR, name)


class _Mapping:
    """One mmap of a /dev/shm file and a uint8 tensor over it."""

    def __init__(self, path: str, nbytes: int | None, create: bool, writable: bool) -> None:
        flags = os.O_RDWR if writable else os.O_RDONLY
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError as e:
            raise ConfigError(f"shared memory {path} already exists: another kvtier store uses "
                              "that name, or a crashed one left it (remove the file)") from e
        except FileNotFoundError as e:
            raise ConfigError(f"no shared memory at {path}: is the store running?") from e
        try:
            if create:
                os.ftruncate(fd, nbytes)
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mflags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if create else 0)
            self.mm = mmap.mmap(fd, size, flags=mflags, prot=prot)
        finally:
            os.close(fd)
        self.nbytes = size
        buf = self.mm if writable else memoryview(self.mm)
        self.tensor = torch.frombuffer(buf, dtype=torch.uint8) if writable else None
        self.view = memoryview(self.mm)

    def close(self) -> None:
        self.tensor = None
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a slot view; the mapping goes when it is dropped


def sweep_orphans(min_age_s: float = 10.0) -> int:
    """Remove /dev/shm files of kvtier stores whose process died without closing them
    (SIGKILL, or an exit that skipped close): an arena's owner holds an exclusive flock on
    its slot directory (`<arena>.dir`) and a daemon on each staging segment for as long as
    it lives, and the kernel drops the lock with the process, whatever namespace it ran in.
    Files younger than min_age_s are left alone (an owner may be between create and lock).
    Returns how many files went."""
    gone, now = 0, time.time()
    for name in os.listdir(SHM_DIR):
        if not name.startswith("kvtier-"):
            continue
        if name.endswith(".dir"):
            victims = [name, name[:-4]]
        elif name.startswith("kvtier-stage-"):
            victims = [name]
        else:
            continue  # an arena: it goes with its directory
        path = os.path.join(SHM_DIR, name)
        try:
            if now - os.stat(path).st_mtime < min_age_s:
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner is alive
        finally:
            os.close(fd)
        for victim in victims:
            try:
                os.unlink(os.path.join(SHM_DIR, victim))
                gone += 1
            except OSError:
                pass
    return gone


class DramTier(ArenaTier):
    def __init__(self, num_slots: int, slot_bytes: int, shm_name: str | None = None) -> None:
        sweep_orphans()  # what killed stores left behind would otherwise pin RAM for good
        self.shm_name = shm_name or f"kvtier-{os.getpid()}-{secrets.token_hex(4)}"
        self._path = shm_path(self.shm_name)
        self._map = _Mapping(self._path, META_BYTES + num_slots * slot_bytes, True, True)
        _META.pack_into(self._map.mm, 0, _META_MAGIC, num_slots, slot_bytes)
        arena = self._map.tensor[META_BYTES:].view(num_slots, slot_bytes)
        arena.zero_()  # pre-fault every page now, not on the first put
        super().__init__(TierKind.DRAM, arena)
        self._pinned = _cuda_pin(arena)
        # We own the arena's name now: a directory file left by a crashed store goes.
        try:
            os.unlink(dir_path(self._path))
        except FileNotFoundError:
            pass
        self.directory = SlotDirectory(dir_path(self._path), num_slots)
        # a store its owner forgets to close still leaves nothing in /dev/shm at exit
        self._unlink_at_exit = weakref.finalize(self, _unlink_all, [self._path,
                                                                   self.directory.path])

    def publish_n(self, slots, hashes) -> None:
        self.directory.publish(slots, hashes)

    def free_n(self, slots, hashes) -> None:
        self.directory.unpublish(slots, hashes)  # before any slot can be handed out again
        super().free_n(slots, hashes)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self.directory.close()
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
        self.arena = torch.empty((0, self.slot_bytes), dtype=torch.uint8)
        self._map.close()
        self._unlink_at_exit.detach()
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _cuda_pin(arena: torch.Tensor) -> bool:
    if not torch.cuda.is_available() or arena.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
    return int(err) == 0


class DramArenaReader:
    """Maps another process's DRAM arena by name (read-only) to copy slots it holds leases on."""

    def __init__(self, shm_name: str) -> None:
        self._map = _Mapping(shm_path(shm_name), None, False, False)
        magic, self.num_slots, self.slot_bytes = _META.unpack_from(self._map.view, 0)
        if magic != _META_MAGIC:
            self._map.close()
            raise ConfigError(f"/dev/shm/{shm_name} is not a kvtier DRAM arena")
        self._closed = False

    def read_into(self, slot: int, dst) -> None:
        """Copy slot `slot` into the writable buffer `dst` (slot_bytes long)."""
        if self._closed:
            raise StoreClosedError("DRAM arena reader is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        start = META_BYTES + slot * self.slot_bytes
        memoryview(dst).cast("B")[:] = self._map.view[start:start + self.slot_bytes]

    def read(self, slot: int) -> bytes:
        out = bytearray(self.slot_bytes)
        self.read_into(slot, out)
        return bytes(out)

    def close(self) -> None:
        self._closed = True
        self._map.close()
