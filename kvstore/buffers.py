"""Turn caller buffers (tensors, numpy arrays, bytes-like) into uint8 views, no copies.

Host bytes become numpy arrays (a CPU tensor's own memory, viewed); only a device tensor
stays a torch tensor. torch is never imported here: a tensor can exist only in a program
that imported it (`loaded_torch`), so the daemon, which stores host bytes alone, runs without it
(importing torch cost the daemon ~2 s of every start, and its thread pools)."""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np

from kvstore.errors import BlockSizeError
from transfer.copy import loaded_torch


class _NoTensor:
    """Stands in for torch.Tensor while torch is not loaded: nothing is an instance."""


def tensor_type() -> type:
    """torch.Tensor, or a class nothing is an instance of while torch is not loaded."""
    torch = loaded_torch()
    return torch.Tensor if torch is not None else _NoTensor


def is_tensor(buf: Any) -> bool:
    return isinstance(buf, tensor_type())


def as_bytes(buf, *, writable: bool = False):
    """A flat uint8 view sharing memory with `buf`: a numpy array for host memory (numpy,
    bytes-like, a CPU tensor), a torch tensor for a device tensor."""
    if is_tensor(buf):
        torch = loaded_torch()
        if buf.is_meta:  # no storage: a get "into" it would report hits with nothing copied
            raise BlockSizeError("a meta tensor holds no bytes: pass a tensor on a real device")
        if not buf.is_contiguous():
            raise BlockSizeError("block tensors must be contiguous (call .contiguous() first)")
        if writable and buf.requires_grad:  # (its bytes written behind autograd's back, as
            # torch refuses an in-place write into a leaf that requires grad)
            raise TypeError("destination tensor requires grad: read into its .detach(), "
                            "or a tensor made without requires_grad")
        flat = buf.detach().reshape(-1).view(torch.uint8)
        return flat.numpy() if flat.device.type == "cpu" else flat
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise BlockSizeError("block arrays must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise TypeError("destination array is read-only")
        return np.asarray(buf).reshape(-1).view(np.uint8)  # (a subclass, np.memmap
        # say, as a plain array: the paths below test for exactly np.ndarray)
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
        return np.empty(0, np.uint8)
    if not view.c_contiguous:
        raise BlockSizeError("block buffers must be contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only sources are only ever read
        return np.frombuffer(view, np.uint8)


def cpu_array(buf) -> np.ndarray | None:
    """A numpy view of host rows: a CPU tensor's (one conversion for a whole `[n, bytes]`
    batch: a torch row and its .numpy() cost ~3 us each), an array as it is (`host_rows`
    gives one), None for anything else."""
    if isinstance(buf, np.ndarray):
        return buf
    return buf.numpy() if is_tensor(buf) and buf.is_cpu else None


_U8 = np.dtype(np.uint8)


def host_rows(buf, n: int, nbytes: int, writable: bool = True) -> np.ndarray | None:
    """A numpy `[n, nbytes]` view of `buf` (writable unless `writable` is False: a put's
    sources) when it already is n blocks of host bytes back to back (a C-contiguous uint8
    CPU tensor or numpy array, `[n, nbytes]` or flat), else None (then `byte_rows` checks it
    and says what is wrong). Reads copy straight into it, puts send or copy straight from
    it: one conversion, no torch view ops (a numpy source made a torch view and back cost
    ~20 us of a 256 KiB TCP put, measured in the loop)."""
    if type(buf) is tensor_type():
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
    if (type(buf) is tensor_type() and buf.is_cpu and not buf.requires_grad
            and buf.is_contiguous() and not buf.is_complex() and buf.nbytes == nbytes):
        return buf.data_ptr()
    return None


def read_rows(dsts, n: int, nbytes: int, same_host: bool, max_by_address: int):
    """A read's destination rows: on the daemon's host, up to `max_by_address` blocks in
    one CPU tensor as its address (`host_address`: direct reads memmove into it), else host
    rows as one numpy `[n, bytes]` view where they allow it (`host_rows`: a TCP read
    receives into it), else `byte_rows`' rows (which check the sizes and say what is
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


def byte_rows(bufs, n: int, nbytes: int, *, writable: bool = False):
    """n blocks of `nbytes`: one buffer holding all n back to back -> `[n, nbytes]`, or a
    sequence of n buffers -> a list of n flat rows. Host rows are numpy arrays, a device
    tensor's are torch tensors (`as_bytes`). Sizes are checked here, once."""
    if isinstance(bufs, (list, tuple)):
        if len(bufs) != n:
            raise BlockSizeError(f"got {len(bufs)} buffers for {n} blocks")
        rows = [as_bytes(b, writable=writable) for b in bufs]
        for i, row in enumerate(rows):
            if _size(row) != nbytes:
                raise BlockSizeError(f"buffer {i} is {_size(row)} bytes; blocks are {nbytes} bytes")
        return rows
    host = host_rows(bufs, n, nbytes, writable)
    if host is not None:  # n host blocks back to back (the daemon's scratch rows, a CPU
        return host  # uint8 tensor): one conversion, no torch view ops (as_bytes' detach,
        # reshape and view: 9.7 us against 3.6 warm, ~8% of a 1 MiB SSD-tier put cold)
    flat = as_bytes(bufs, writable=writable)
    if _size(flat) != n * nbytes:
        raise BlockSizeError(f"buffer is {_size(flat)} bytes; {n} blocks need {n * nbytes} bytes")
    return flat.reshape(n, nbytes) if isinstance(flat, np.ndarray) else flat.view(n, nbytes)


def _size(row) -> int:
    return row.size if isinstance(row, np.ndarray) else row.numel()


def select_rows(rows, idx: Sequence[int]):
    """The rows at `idx` (of a `[n, bytes]` tensor or array, or a sequence of rows), keeping
    the single-buffer form when all rows are taken in order."""
    if (isinstance(rows, (tensor_type(), np.ndarray)) and len(idx) == rows.shape[0]
            and list(idx) == list(range(len(idx)))):
        return rows
    return [rows[i] for i in idx]
