"""Descriptor lists: (region, offset, length) triples held as numpy arrays, prepared once.

The hot path never walks descriptors in Python to validate them: `prepare` checks a whole
list against the registered ranges in one vectorized pass, and `post` selects descriptors
with index arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from .errors import Fault, TransferError
from .memory import Region
from .types import BackendKind


def _i64(a: Any, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(a, dtype=np.int64).reshape(-1)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True)
class DescList:
    """Descriptors as parallel int64 arrays; region ids are the owner's registration ids."""

    region_ids: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    def __post_init__(self) -> None:
        for name in ("region_ids", "offsets", "lengths"):
            object.__setattr__(self, name, _i64(getattr(self, name), name))
        if not (self.region_ids.size == self.offsets.size == self.lengths.size):
            raise TransferError(Fault.INVALID, "DescList arrays must have the same length")

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    @classmethod
    def from_tuples(cls, descs: Iterable[tuple[Region | int, int, int]]) -> "DescList":
        rows = [(r.region_id if isinstance(r, Region) else int(r), o, n) for r, o, n in descs]
        arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
        return cls(arr[:, 0], arr[:, 1], arr[:, 2])

    @classmethod
    def uniform(cls, region: Region | int, length: int, count: int, start: int = 0,
                stride: int | None = None) -> "DescList":
        """`count` slots of `length` bytes, `stride` apart (default: packed) from `start`."""
        rid = region.region_id if isinstance(region, Region) else int(region)
        offsets = start + np.arange(count, dtype=np.int64) * (stride or length)
        return cls(np.full(count, rid), offsets, np.full(count, length))


@dataclass(frozen=True, eq=False)
class Prepared:
    """A validated descriptor list bound to an agent (peer None) or to one peer + backend."""

    agent: str
    peer: str | None
    backend: BackendKind | None  # None for the local side; chosen per peer for the remote
    descs: DescList
    regions: dict[int, Region] = field(default_factory=dict, repr=False)  # local side only

    def __len__(self) -> int:
        return len(self.descs)


def as_index(idx: Any, n: int, what: str) -> np.ndarray:
    """An int64 index array into a prepared list of `n` descriptors (None: all of them)."""
    if idx is None:
        return np.arange(n, dtype=np.int64)
    arr = np.asarray(idx)
    if arr.dtype.kind not in "iu":
        raise TransferError(Fault.INVALID, f"{what} must be an integer index array")
    arr = arr.astype(np.int64, copy=False).reshape(-1)
    if arr.size == 1:  # (one block, the common case: no reductions)
        outside = not 0 <= int(arr[0]) < n
    else:
        outside = bool(arr.size) and (arr.min() < 0 or arr.max() >= n)
    if outside:
        raise TransferError(Fault.OUT_OF_RANGE,
                            f"{what} indexes outside a prepared list of {n} descriptors")
    return arr
