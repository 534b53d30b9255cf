"""The slot directory's loops in C (kvstore/_slotdir.c) against slotdir.py's own (the
oracle): the same bytes in the shared memory after every step, the same lookups, and bad
arguments refused before anything is written. (test_slotdir.py runs the directory's own
tests with either.)"""
from __future__ import annotations

import numpy as np
import pytest

from kvstore import slotdir
from kvstore.slotdir import SlotDirectory, SlotDirectoryReader

from .test_slotdir import h, pair  # noqa: F401 - (a fixture: used by name)


def test_the_module_is_built_here():
    """Optional at install (no C compiler: the Python loops), but this install has one."""
    assert slotdir._slotdir is not None, "kvstore._slotdir is not built: reinstall kvtier " \
                                         "with a C compiler (pip install -e .)"


def test_the_c_loops_leave_the_bytes_the_python_ones_do(monkeypatch):
    """Random publishes and unpublishes (crowded buckets, probes wrapping past the table's
    end, slots published twice and unpublished when free) into two directories, one by
    kvstore/_slotdir.c and one by slotdir.py's loops: the same generations, owners and
    table entries after every step, and the same answer from both readers' `find`."""
    c_loops = slotdir._slotdir
    rng = np.random.default_rng(7)
    a, b = SlotDirectory(40), SlotDirectory(40)
    ra, rb = SlotDirectoryReader(a.share_fd(), 40), SlotDirectoryReader(b.share_fd(), 40)
    last = a._v.table_size - 1
    keys = [h(i, bucket=int(rng.choice([3, last, i * 7919]))) for i in range(120)]
    try:
        for step in range(600):
            n = int(rng.integers(1, 6))
            slots = rng.integers(0, 40, n).tolist()
            ks = [keys[int(k)] for k in rng.integers(0, len(keys), n)]
            op = "publish" if rng.random() < 0.6 else "unpublish"
            getattr(a, op)(slots, ks)  # C
            monkeypatch.setattr(slotdir, "_slotdir", None)
            getattr(b, op)(slots, ks)  # Python
            monkeypatch.setattr(slotdir, "_slotdir", c_loops)
            assert bytes(a._v.raw) == bytes(b._v.raw), f"step {step}: {op} {slots}"
            probe = keys[int(rng.integers(0, len(keys)))]
            got = ra.find(probe)
            monkeypatch.setattr(slotdir, "_slotdir", None)
            assert got == rb.find(probe)
            monkeypatch.setattr(slotdir, "_slotdir", c_loops)
    finally:
        for d in (ra, rb, a, b):
            d.close()


def test_the_c_loops_refuse_what_is_no_directory_or_no_hash(pair):
    """Views of different directories, a slot outside it, a hash that is not 16 bytes:
    refused with ValueError (a slot checked before anything is written); an empty hash
    for a slot never published, as a grant given back passes, changes nothing."""
    writer, reader = pair
    v = writer._v
    before = bytes(v.raw)
    with pytest.raises(ValueError, match="not one of the directory"):
        slotdir._slotdir.publish(v.gen, v.owner, v.table, [3, 32], [h(1), h(2)])
    with pytest.raises(ValueError, match="not the views"):
        slotdir._slotdir.publish(v.gen, v.owner[:16], v.table, [0], [h(1)])
    with pytest.raises(ValueError, match="hash 0 is not 16 bytes"):
        slotdir._slotdir.publish(v.gen, v.owner, v.table, [0], [b"short"])
    assert bytes(v.raw) == before
    writer.unpublish([4, 5], [b"", b""])  # never published: nothing to look up
    assert bytes(v.raw) == before
    with pytest.raises((TypeError, BufferError)):  # a reader's views are read-only
        slotdir._slotdir.publish(reader._v.gen, reader._v.owner, reader._v.table, [0], [h(1)])
