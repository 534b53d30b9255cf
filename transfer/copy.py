"""Memory-to-memory copies for the local and shm backends, batched per transfer.

Adjacent descriptors that are contiguous on both sides are merged in one vectorized pass,
so the Python loop runs once per contiguous run, not once per descriptor.
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any, Sequence

import numpy as np

try:
    from transfer import _stream
except ImportError:  # built without a C compiler: every copy goes through numpy / libc
    _stream = None

STREAMING = _stream is not None
# A copy into a slot a put fills (`cold`: nothing reads it again soon) of this many bytes
# or more stores around the caches (transfer/_stream.c). glibc's memcpy does so only above
# a threshold it derives from the L3 size (181 MiB on a VM reporting 480 MiB), so a put's
# block copy read each destination line from memory first and evicted the caches the code
# around it runs from. On that VM, 960 MiB in blocks into slots not just written: 256 KiB
# 43 -> 30 us, 1 MiB 165 -> 105, 4 MiB 655 -> 411. Other copies keep to the caches: a get
# lands where its reader is about to look (bench/store_service.py re-reading one stored
# 1 MiB block into one buffer: 42 -> 65 us at p50 streamed).
STREAM_COLD_BYTES = 256 << 10

memmove = ctypes.memmove
"""memmove(dst_address, src_address, nbytes): one single-threaded libc memmove between
two host addresses, for callers that hold both as ints (no view of either side made); the
caller keeps both buffers alive and in bounds."""

_copy_at = getattr(_stream, "copy_at", None)


def copy_at(dst_address: int, src_address: int, nbytes: int, cold: bool = False) -> None:
    """`memmove` for two buffers that do not overlap, stored around the caches when `cold`
    and big (as copy_arrays); the caller keeps both alive and in bounds."""
    if cold and nbytes >= STREAM_COLD_BYTES and _copy_at is not None:
        _copy_at(dst_address, src_address, nbytes)
    else:
        memmove(dst_address, src_address, nbytes)


def loaded_torch():
    """torch if the program imported it (a tensor can only exist then); never imports it
    (the daemon and the SDK run without it: seconds of start-up and its thread pools)."""
    return sys.modules.get("torch")


def coalesce(dst_ids: np.ndarray, dst_offs: np.ndarray, src_ids: np.ndarray,
             src_offs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    """Merge runs of descriptors that continue each other on both sides."""
    if lengths.size < 2:
        return dst_ids, dst_offs, src_ids, src_offs, lengths
    cont = ((dst_ids[1:] == dst_ids[:-1]) & (src_ids[1:] == src_ids[:-1])
            & (dst_offs[:-1] + lengths[:-1] == dst_offs[1:])
            & (src_offs[:-1] + lengths[:-1] == src_offs[1:]))
    if not cont.any():
        return dst_ids, dst_offs, src_ids, src_offs, lengths
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return (dst_ids[starts], dst_offs[starts], src_ids[starts], src_offs[starts],
            np.add.reduceat(lengths, starts))


def copy_bytes(dst: Any, src: Any, cold: bool = False) -> None:
    """dst[...] = src for two buffers of the same bytes (torch tensors or numpy arrays).
    `cold`: the destination will not be read again soon (a slot a put fills).

    Host to host it is one single-threaded copy: torch's CPU `copy_` runs on its
    intra-op thread pool, whose threads spin and wait on a busy host (a 256 KiB copy
    measured 24 ms with 2 torch threads and 25 us with 1 on a loaded 2-core machine). A
    `cold` one of STREAM_COLD_BYTES or more bypasses the caches (transfer._stream), any
    other is numpy's memcpy. A device tensor on either side goes through torch (the host
    side viewed, not copied). Every hot-path host copy in the project goes through here."""
    if type(dst) is np.ndarray and type(src) is np.ndarray and dst.shape == src.shape:
        copy_arrays(dst, src, cold)  # two host arrays (the same-host paths): no conversions
        return
    d = dst.numpy() if _is_cpu_tensor(dst) else dst
    s = src.numpy() if _is_cpu_tensor(src) else src
    if isinstance(d, np.ndarray) and isinstance(s, np.ndarray):
        copy_arrays(d, s.reshape(d.shape) if s.shape != d.shape else s, cold)
    else:
        _torch_view(d).copy_(_torch_view(s).reshape(_torch_view(d).shape))


def copy_arrays(d: np.ndarray, s: np.ndarray, cold: bool = False) -> None:
    """d[...] = s for two host arrays of one shape (copy_bytes without the conversions):
    streamed when `cold`, big, both contiguous and of one dtype; numpy's copy otherwise
    (it casts nothing either, and says what is wrong)."""
    if cold and d.nbytes >= STREAM_COLD_BYTES and _stream is not None and d.dtype == s.dtype:
        try:
            _stream.copy(d, s)
            return
        except (BufferError, TypeError):  # strided, or a read-only destination
            pass
    np.copyto(d, s, casting="no")


def _is_cpu_tensor(buf: Any) -> bool:
    torch = loaded_torch()
    return torch is not None and isinstance(buf, torch.Tensor) and buf.device.type == "cpu"


def _torch_view(buf: Any) -> Any:
    return loaded_torch().from_numpy(buf) if isinstance(buf, np.ndarray) else buf


class Unreachable(Exception):
    """A guarded copy (`copy_runs(..., guard=True)`) met a page it could not reach: a
    mapped file shrunk under its mapping (SIGBUS, caught). `run`: the index of that run;
    the runs before it were copied, this one in part or not at all. `region`: the remote
    region of that run, where `copy_job` raised it."""

    def __init__(self, run: int) -> None:
        super().__init__(f"run {run} of the copy reached past the end of a mapped file")
        self.run = run
        self.region: int | None = None


_guarded_copy_runs = getattr(_stream, "guarded_copy_runs", None)


def guarded_copy(dst: np.ndarray, src: np.ndarray) -> bool:
    """dst[:] = src for host uint8 arrays of one size, False where a page of either could
    not be reached (a mapped file shrunk under it: see copy_runs); a plain copy without
    transfer._stream."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into a buffer of {dst.nbytes}")
    if _guarded_copy_runs is None:
        dst[:] = src
        return True
    return _guarded_copy_runs([dst], [0], [src], [0], [dst.nbytes]) < 0


def copy_runs(dst: Sequence[Any], dst_offs: np.ndarray, src: Sequence[Any],
              src_offs: np.ndarray, lengths: np.ndarray, guard: bool = False) -> None:
    """dst[i][dst_offs[i]:+len] = src[i][src_offs[i]:+len]; buffers are uint8 numpy or torch.
    `guard`: host copies of mappings another process may shrink (a peer's region file)
    raise Unreachable where a page is gone, where a plain copy's SIGBUS killed the process
    (transfer._stream.guarded_copy; without that module, plain copies)."""
    if guard and _guarded_copy_runs is not None and all(
            isinstance(b, np.ndarray) for b in (*dst, *src)):  # (the lot in one call)
        bad = _guarded_copy_runs(dst, dst_offs.tolist(), src, src_offs.tolist(),
                                 lengths.tolist())
        if bad >= 0:
            raise Unreachable(bad)
        return
    for k, (d, do, s, so, n) in enumerate(zip(dst, dst_offs.tolist(), src, src_offs.tolist(),
                                              lengths.tolist())):
        if isinstance(d, np.ndarray) and isinstance(s, np.ndarray):
            if not guard:
                d[do:do + n] = s[so:so + n]
            elif not guarded_copy(d[do:do + n], s[so:so + n]):  # (a torch tensor in the lot)
                raise Unreachable(k)
        else:  # a device tensor on one side: torch moves it (host side viewed, not copied)
            copy_bytes(_torch_view(d)[do:do + n], _torch_view(s)[so:so + n])


def region_buffers(ids: np.ndarray, lookup: dict[int, Any]) -> list[Any]:
    """Per-descriptor buffer list from a region id → buffer map (one dict lookup per run)."""
    return [lookup[i] for i in ids.tolist()]


def copy_job(write: bool, local: dict[int, Any], local_ids: np.ndarray,
             local_offs: np.ndarray, remote: dict[int, Any], remote_ids: np.ndarray,
             remote_offs: np.ndarray, lengths: np.ndarray, guard: bool = False) -> None:
    """Run one transfer as copies: WRITE local → remote, READ remote → local (`guard`: as
    copy_runs; Unreachable's `region` then names the remote region of the run it met)."""
    if write:
        dst_ids, dst_offs, src_ids, src_offs, lens = coalesce(
            remote_ids, remote_offs, local_ids, local_offs, lengths)
        dst_map, src_map = remote, local
    else:
        dst_ids, dst_offs, src_ids, src_offs, lens = coalesce(
            local_ids, local_offs, remote_ids, remote_offs, lengths)
        dst_map, src_map = local, remote
    try:
        copy_runs(region_buffers(dst_ids, dst_map), dst_offs, region_buffers(src_ids, src_map),
                  src_offs, lens, guard)
    except Unreachable as e:
        e.region = int((dst_ids if write else src_ids)[e.run])
        raise
