"""Turn caller buffers (tensors, numpy arrays, bytes-like) into uint8 torch views, no copies."""
from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from kvstore.errors import BlockSizeError


def as_byte_tensor(buf, *, writable: bool = False) -> torch.Tensor:
    """A flat uint8 tensor sharing memory with `buf`."""
    if isinstance(buf, torch.Tensor):
        if buf.is_meta:  # no storage: a get "into" it would report hits with nothing copied
            raise BlockSizeError("a meta tensor holds no bytes: pass a tensor on a real device")
        if not buf.is_contiguous():
            raise BlockSizeError("block tensors must be contiguous (call .contiguous() first)")
        if writable and buf.requires_grad:  # (its bytes written behind autograd's back, as
            # torch refuses an in-place write into a leaf that requires grad)
            raise TypeError("destination tensor requires grad: read into its .detach(), "
                            "or a tensor made without requires_grad")
        return buf.reshape(-1).view(torch.uint8)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise BlockSizeError("block arrays must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise TypeError("destination array is read-only")
        buf = buf.reshape(-1).view(np.uint8)
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"block buffers are tensors, numpy arrays or bytes-like objects (one "
                        f"for the batch or a list, one per block); got {type(buf).__name__}") \
            from None
    if writable and view.readonly:
        raise TypeError(f"destination buffer ({type(buf).__name__}) is read-only; pass a "
                        "bytearray, numpy array or tensor")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only sources are only ever read
        return torch.frombuffer(view, dtype=torch.uint8)


def cpu_array(buf) -> np.ndarray | None:
    """A numpy view of host rows: a CPU tensor's (one conversion for a whole `[n, bytes]`
    batch: a torch row and its .numpy() cost ~3 us each), an array as it is (`host_rows`
    gives one), None for anything else."""
    if isinstance(buf, np.ndarray):
        return buf
    return buf.numpy() if isinstance(buf, torch.Tensor) and buf.is_cpu else None


_U8 = np.dtype(np.uint8)


def host_rows(buf, n: int, nbytes: int, writable: bool = True) -> np.ndarray | None:
    """A numpy `[n, nbytes]` view of `buf` (writable unless `writable` is False: a put's
    sources) when it already is n blocks of host bytes back to back (a C-contiguous uint8
    CPU tensor or numpy array, `[n, nbytes]` or flat), else None (then `byte_rows` checks it
    and says what is wrong). Reads copy straight into it, puts send or copy straight from
    it: one conversion, no torch view ops (a numpy source made a torch view and back cost
    ~20 us of a 256 KiB TCP put, measured in the loop)."""
    if type(buf) is torch.Tensor:
        try:
            a = buf.numpy()  # refuses device tensors and ones that need grad
        except (TypeError, RuntimeError):
            return None
    elif type(buf) is np.ndarray:
        a = buf
    else:
        return None
    if a.dtype != _U8 or not a.flags.c_contiguous or (writable and not a.flags.writeable):
        return None
    if a.shape == (n, nbytes):
        return a
    return a.reshape(n, nbytes) if a.ndim == 1 and a.shape[0] == n * nbytes else None


def host_address(buf, nbytes: int) -> int | None:
    """The address of `buf` when it is one contiguous CPU tensor of exactly `nbytes` (any
    real dtype and shape), else None. A same-host read of a few blocks copies into it by
    address: a tensor's `.numpy()` alone cost ~2 us of a ~45 us 1 MiB read, its address
    ~0.2 us. (A numpy array's address costs as much as its view: arrays keep `host_rows`.)
    The caller keeps `buf` alive for as long as it uses the address."""
    if (type(buf) is torch.Tensor and buf.is_cpu and not buf.requires_grad
            and buf.is_contiguous() and not buf.is_complex() and buf.nbytes == nbytes):
        return buf.data_ptr()
    return None


def read_rows(dsts, n: int, nbytes: int, same_host: bool, max_by_address: int):
    """A read's destination rows: on the daemon's host, up to `max_by_address` blocks in
    one CPU tensor as its address (`host_address`: direct reads memmove into it), else host
    rows as one numpy `[n, bytes]` view where they allow it (`host_rows`: a TCP read
    receives into it), else `byte_rows`' tensors (which check the sizes and say what is
    wrong)."""
    if same_host and n <= max_by_address and (at := host_address(dsts, n * nbytes)):
        return at
    host = host_rows(dsts, n, nbytes)
    return host if host is not None else byte_rows(dsts, n, nbytes, writable=True)


def request_rows(rows, dsts, n: int, nbytes: int):
    """`read_rows`' rows for a request: an address becomes `dsts`' rows again."""
    if type(rows) is int:
        host = host_rows(dsts, n, nbytes)
        return host if host is not None else byte_rows(dsts, n, nbytes, writable=True)
    return rows


def byte_rows(bufs, n: int, nbytes: int, *, writable: bool = False) -> torch.Tensor | list[torch.Tensor]:
    """n blocks of `nbytes`: one buffer holding all n back to back -> `[n, nbytes]`, or a
    sequence of n buffers -> a list of n flat tensors. Sizes are checked here, once."""
    if isinstance(bufs, (list, tuple)):
        if len(bufs) != n:
            raise BlockSizeError(f"got {len(bufs)} buffers for {n} blocks")
        rows = [as_byte_tensor(b, writable=writable) for b in bufs]
        for i, row in enumerate(rows):
            if row.numel() != nbytes:
                raise BlockSizeError(f"buffer {i} is {row.numel()} bytes; blocks are {nbytes} bytes")
        return rows
    if (isinstance(bufs, torch.Tensor) and bufs.dtype is torch.uint8 and bufs.dim() == 2
            and bufs.shape[0] == n and bufs.shape[1] == nbytes and bufs.is_contiguous()
            and not bufs.is_meta):
        return bufs  # already [n, nbytes] bytes (the daemon's scratch rows): no view ops
    flat = as_byte_tensor(bufs, writable=writable)
    if flat.numel() != n * nbytes:
        raise BlockSizeError(f"buffer is {flat.numel()} bytes; {n} blocks need {n * nbytes} bytes")
    return flat.view(n, nbytes)


def select_rows(rows, idx: Sequence[int]):
    """The rows at `idx` (of a `[n, bytes]` tensor or array, or a sequence of rows), keeping
    the single-buffer form when all rows are taken in order."""
    if (isinstance(rows, (torch.Tensor, np.ndarray)) and len(idx) == rows.shape[0]
            and list(idx) == list(range(len(idx)))):
        return rows
    return [rows[i] for i in idx]
