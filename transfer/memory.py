"""Registered memory: what an agent may copy from or into, and what peers may address.

A `Region` wraps one contiguous buffer as flat bytes. Host memory (numpy, CPU tensors, shm,
mmapped files) is held as a uint8 numpy view; device tensors as a flat uint8 torch view.
Region ids are never reused, so a stale id held by a peer cannot alias a newer region.
"""
from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .copy import copy_bytes, loaded_torch
from .errors import Fault, TransferError
from .shm import ShmSegment, map_path
from .types import MemKind


@dataclass(frozen=True)
class FileRegion:
    """`length` bytes of the file at `path` from `offset`; registered by mmapping it shared."""

    path: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"FileRegion needs offset >= 0 and length > 0, got {self}")


@dataclass(eq=False)
class Region:
    """A registration handle. `host` is set for host memory, `device` for device tensors."""

    region_id: int
    kind: MemKind
    size: int
    exported: bool
    host: np.ndarray | None = None
    device: Any = None
    path: str | None = None  # set when same-host peers can map it (shm, file)
    path_offset: int = 0
    _keep: Any = field(default=None, repr=False)  # the user's object or our mmap

    def host_slice(self, offset: int, length: int) -> np.ndarray:
        assert self.host is not None
        return self.host[offset:offset + length]


def _flat_numpy(arr: np.ndarray) -> np.ndarray:
    if not arr.flags.c_contiguous:
        raise TransferError(Fault.INVALID, "numpy array must be C-contiguous to register")
    return arr.reshape(-1).view(np.uint8)


def _flat_torch(t) -> Any:
    if not t.is_contiguous():
        raise TransferError(Fault.INVALID, "tensor must be contiguous to register")
    return t.reshape(-1).view(loaded_torch().uint8)


def make_region(region_id: int, memory: Any, exported: bool) -> Region:
    """Wrap `memory` (numpy array, torch tensor, ShmSegment, FileRegion) as a Region."""
    if isinstance(memory, ShmSegment):
        return Region(region_id, MemKind.SHM, memory.size, exported, host=memory.array,
                      path=memory.path, _keep=memory)
    if isinstance(memory, FileRegion):
        try:
            mm, view = map_path(memory.path, memory.length, memory.offset)
        except (OSError, ValueError) as e:
            raise TransferError(Fault.INVALID, f"cannot map {memory}: {e}") from e
        return Region(region_id, MemKind.FILE, memory.length, exported, host=view,
                      path=memory.path, path_offset=memory.offset, _keep=mm)
    if isinstance(memory, np.ndarray):
        if not memory.flags.writeable:  # (a READ into it killed the receiving thread)
            raise TransferError(Fault.INVALID, "read-only arrays cannot be registered")
        flat = _flat_numpy(memory)
        return Region(region_id, MemKind.HOST, flat.nbytes, exported, host=flat, _keep=memory)
    torch = loaded_torch()
    if torch is not None and isinstance(memory, torch.Tensor):
        flat = _flat_torch(memory)
        if flat.device.type == "cpu":
            host = flat.numpy()
            return Region(region_id, MemKind.HOST, host.nbytes, exported, host=host,
                          _keep=memory)
        return Region(region_id, MemKind.DEVICE, flat.numel(), exported, device=flat,
                      _keep=memory)
    if isinstance(memory, (bytearray, mmap.mmap, memoryview)):
        flat = np.frombuffer(memory, dtype=np.uint8)
        if flat.flags.writeable is False:
            raise TransferError(Fault.INVALID, "read-only buffers cannot be registered")
        return Region(region_id, MemKind.HOST, flat.nbytes, exported, host=flat, _keep=memory)
    raise TransferError(Fault.INVALID, f"cannot register {type(memory).__name__}: expected a "
                        "numpy array, torch tensor, ShmSegment, FileRegion or writable buffer")


class RegionTable:
    """The agent's registrations; `sizes` is indexed by region id (-1: none) for batch checks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # peers' requests in progress on each region, and the connections serving them: a
        # deregister ends those and waits for them (a slow peer went on reading and writing
        # memory its owner had deregistered and reused: 4 MiB landed after it returned)
        self._busy: dict[int, dict[Any, int]] = {}
        self._regions: dict[int, Region] = {}
        self._next_id = 1
        self.sizes = np.full(1, -1, dtype=np.int64)  # replaced, never mutated in place
        self.exported_sizes = self.sizes

    def add(self, memory: Any, exported: bool) -> Region:
        with self._lock:
            region = make_region(self._next_id, memory, exported)
            if region.size <= 0:
                raise TransferError(Fault.INVALID, "cannot register an empty buffer")
            self._next_id += 1
            self._regions[region.region_id] = region
            self._rebuild()
            return region

    def remove(self, region: Region) -> list:
        """Unregister `region`; returns the connections serving peers' requests on it now
        (close them, then `wait_idle`)."""
        with self._lock:
            if self._regions.pop(region.region_id, None) is None:
                raise TransferError(Fault.UNREGISTERED,
                                    f"region {region.region_id} is not registered")
            self._rebuild()
            return list(self._busy.get(region.region_id, {}))

    def wait_idle(self, region: Region, timeout_s: float) -> bool:
        """Wait until no peer's request is in progress on `region` (False: still one after
        `timeout_s`)."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._busy.get(region.region_id),
                                       timeout_s)

    def use(self, ids: list[int], conn) -> dict[int, Region]:
        """The exported regions `ids`, each marked in use by `conn` until `done` (a peer's
        request on them is in progress); TransferError UNREGISTERED for one that is not."""
        with self._lock:
            regions = {}
            for i in ids:
                r = self._regions.get(i)
                if r is None or not r.exported:
                    raise TransferError(Fault.UNREGISTERED, f"region {i} is not registered/"
                                        "exported")
                regions[i] = r
            for i in ids:
                users = self._busy.setdefault(i, {})
                users[conn] = users.get(conn, 0) + 1
            return regions

    def done(self, ids: list[int], conn) -> None:
        with self._lock:
            for i in ids:
                users = self._busy.get(i, {})
                users[conn] -= 1
                if not users[conn]:
                    del users[conn]
                if not users:
                    self._busy.pop(i, None)
            self._idle.notify_all()

    def get(self, region_id: int) -> Region:
        try:
            return self._regions[region_id]
        except KeyError:
            raise TransferError(Fault.UNREGISTERED,
                                f"region {region_id} is not registered") from None

    def exported(self) -> list[Region]:
        return [r for r in self._regions.values() if r.exported]

    def _rebuild(self) -> None:
        sizes = np.full(self._next_id, -1, dtype=np.int64)
        exported = sizes.copy()
        for r in self._regions.values():
            sizes[r.region_id] = r.size
            if r.exported:
                exported[r.region_id] = r.size
        self.sizes, self.exported_sizes = sizes, exported


def check_ranges(sizes: np.ndarray, ids: np.ndarray, offsets: np.ndarray,
                 lengths: np.ndarray) -> None:
    """Raise TransferError unless every (id, offset, length) lies inside a known region."""
    if ids.size == 0:
        return
    if ids.size == 1:  # one block, the common case: plain ints (the arrays' ten numpy
        i, o, n = int(ids[0]), int(offsets[0]), int(lengths[0])  # calls took ~10 us)
        size = int(sizes[i]) if 0 <= i < sizes.size else -1
        if size >= 0 and o >= 0 and n > 0 and o + n <= size:
            return
    known = (ids >= 0) & (ids < sizes.size)
    region_sizes = np.where(known, sizes[np.where(known, ids, 0)], -1)
    if (region_sizes < 0).any():
        bad = int(ids[region_sizes < 0][0])
        raise TransferError(Fault.UNREGISTERED, f"region {bad} is not registered/exported")
    # (offsets + lengths could wrap round int64: a peer's 2**62 + 2**62 passed as in range)
    bad = (offsets < 0) | (lengths <= 0) | (offsets > region_sizes) | \
        (lengths > region_sizes - offsets)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TransferError(Fault.OUT_OF_RANGE,
                            f"descriptor {i} (region {int(ids[i])}, offset {int(offsets[i])}, "
                            f"length {int(lengths[i])}) outside region of "
                            f"{int(region_sizes[i])} bytes")


def host_views(regions: dict[int, Region], ids: np.ndarray, offsets: np.ndarray,
               lengths: np.ndarray, incoming: bool) -> tuple[list, list]:
    """Host byte views for a socket to send from (incoming=False) or receive into.

    Host memory is viewed in place. Device memory is staged through a host copy; for
    incoming data the returned `finish` list holds the copies to run after the bytes landed.
    """
    views, finish = [], []
    for i, off, n in zip(ids.tolist(), offsets.tolist(), lengths.tolist()):
        region = regions[i]
        if region.host is not None:
            views.append(region.host[off:off + n])
        elif incoming:
            stage = np.empty(n, dtype=np.uint8)
            views.append(stage)
            finish.append((region.device[off:off + n], stage))
        else:
            views.append(region.device[off:off + n].cpu().numpy())
    return views, finish


def finish_staged(finish: list) -> None:
    for device_slice, stage in finish:
        copy_bytes(device_slice, stage)
