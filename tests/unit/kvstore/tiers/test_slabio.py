"""The SSD tier's C payload I/O (kvstore/tiers/_slabio.c) against the tier's own checksum
(kvstore.layout.checksum: the xxhash package) and plain reads of the file: every byte where
it belongs, zeros in each slot's pad, nothing outside the slots written, the checksum of
every block whatever the way it was cut into calls, unreadable blocks as None, and bad
arguments refused before any I/O."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kvstore.layout import checksum
from kvstore.tiers import slabfile

_slabio = slabfile._slabio


def test_the_module_is_built_and_bound_here():
    """Optional at install (no C compiler: the Python path), but this install has one: a
    build that failed silently would leave every SSD tier on the slower path."""
    assert _slabio is not None and slabfile.NATIVE, (
        "kvstore.tiers._slabio is missing or could not find xxhash's XXH3 functions: "
        "reinstall kvtier with a C compiler (pip install -e .)")


def _blocks(n: int, length: int, seed: int) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, length, dtype=np.uint8)) for _ in range(n)]


@pytest.mark.parametrize("length,stride,per_call,piece", [
    (1000, 4096, 1, 0),        # small, padded, a call each
    (1000, 4096, 3, 0),        # small, padded, runs of 3 (the last run short)
    (4096, 4096, 500, 0),      # page-sized, every block in one call
    (5000, 8192, 2, 0),        # padded over a page
    (3000, 4096, 1, 700),      # in pieces of 700, the last short, then the pad
    (8192, 8192, 1, 4096),     # pieces that divide the block
    (1 << 20, 1 << 20, 1, 256 << 10),  # as the tier moves 1 MiB blocks
])
def test_blocks_land_in_their_slots_with_the_tiers_checksum_and_read_back(
        tmp_path, length, stride, per_call, piece):
    path = tmp_path / "slabs"
    n, first = 7, 2
    with open(path, "wb") as f:  # 0xAB around the slots: nothing of it may change
        f.write(b"\xab" * ((first + n + 1) * stride))
    fd = os.open(path, os.O_RDWR)
    try:
        blocks = _blocks(n, length, seed=length)
        sums = _slabio.write_blocks(fd, first * stride, blocks, stride, per_call, piece)
        assert sums == [checksum(b) for b in blocks]
        raw = path.read_bytes()
        assert raw[:first * stride] == b"\xab" * (first * stride)
        assert raw[(first + n) * stride:] == b"\xab" * stride
        for i, b in enumerate(blocks):
            at = (first + i) * stride
            assert raw[at:at + length] == bytes(b)
            assert raw[at + length:at + stride] == bytes(stride - length)
        out = [memoryview(np.zeros(length, np.uint8)) for _ in range(n)]
        assert _slabio.read_blocks(fd, first * stride, out, stride, per_call, piece) == sums
        assert [bytes(o) for o in out] == [bytes(b) for b in blocks]
    finally:
        os.close(fd)


@pytest.mark.parametrize("per_call,piece", [(1, 0), (4, 0), (1, 300)])
def test_blocks_past_the_end_of_the_file_are_none_and_the_rest_read(tmp_path, per_call, piece):
    """The file cut inside the fifth block: blocks 0-3 read (a failed run is read again a
    block at a time), 4-5 are None."""
    path, length, stride = tmp_path / "slabs", 1000, 4096
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        blocks = _blocks(6, length, seed=1)
        sums = _slabio.write_blocks(fd, 0, blocks, stride, per_call, piece)
        os.ftruncate(fd, 4 * stride + 500)
        out = [memoryview(np.zeros(length, np.uint8)) for _ in range(6)]
        got = _slabio.read_blocks(fd, 0, out, stride, per_call, piece)
        assert got == sums[:4] + [None, None]
        assert [bytes(o) for o in out[:4]] == [bytes(b) for b in blocks[:4]]
    finally:
        os.close(fd)


def test_a_write_the_kernel_refuses_raises_its_errno(tmp_path):
    path = tmp_path / "slabs"
    path.write_bytes(bytes(8192))
    fd = os.open(path, os.O_RDONLY)
    try:
        for piece in (0, 300):
            with pytest.raises(OSError) as e:
                _slabio.write_blocks(fd, 0, _blocks(2, 1000, seed=2), 4096, 1, piece)
            assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:  # a closed descriptor
        _slabio.write_blocks(fd, 0, _blocks(1, 1000, seed=2), 4096, 1, 0)
    assert e.value.errno == errno.EBADF
    assert path.read_bytes() == bytes(8192)


def test_bad_arguments_are_refused_before_any_io(tmp_path):
    path = tmp_path / "slabs"
    path.write_bytes(bytes(4 * 8192))
    fd = os.open(path, os.O_RDWR)
    try:
        a, b = _blocks(1, 1000, seed=3)[0], _blocks(1, 999, seed=3)[0]
        with pytest.raises(ValueError, match="block 1 is 999 bytes"):
            _slabio.write_blocks(fd, 0, [a, b], 4096, 1, 0)
        with pytest.raises(ValueError, match="do not fit"):  # bigger than its slot
            _slabio.write_blocks(fd, 0, [a], 512, 1, 0)
        with pytest.raises(ValueError, match="do not fit"):  # a pad of more than a page
            _slabio.write_blocks(fd, 0, [a], 8192, 1, 0)
        with pytest.raises(ValueError, match="piece"):
            _slabio.write_blocks(fd, 0, [a], 4096, 1, -1)
        with pytest.raises(TypeError):
            _slabio.write_blocks(fd, 0, 5, 4096, 1, 0)
        with pytest.raises((BufferError, TypeError)):  # read into read-only memory
            _slabio.read_blocks(fd, 0, [bytes(1000)], 4096, 1, 0)
        with pytest.raises((BufferError, TypeError, ValueError)):  # not contiguous
            _slabio.write_blocks(fd, 0, [np.zeros(2000, np.uint8)[::2]], 4096, 1, 0)
        for offset in (-4096, (1 << 63) - 4096):  # before the file, or past what off_t holds
            with pytest.raises(ValueError, match="do not fit a file"):
                _slabio.write_blocks(fd, offset, [a, a], 4096, 1, 0)
            with pytest.raises(ValueError, match="do not fit a file"):
                _slabio.read_blocks(fd, offset, [bytearray(1000)] * 2, 4096, 1, 0)
        assert path.read_bytes() == bytes(4 * 8192)
        assert _slabio.write_blocks(fd, 0, [], 4096, 1, 0) == []
        assert _slabio.read_blocks(fd, 0, [], 4096, 1, 0) == []
    finally:
        os.close(fd)


def test_binding_again_changes_nothing():
    """The XXH3 functions are bound once: a later bind (of anything) keeps them, so a call
    in flight never mixes two libraries' functions."""
    assert _slabio.bind("/nonexistent/library.so") is True
    block = _blocks(1, 5000, seed=4)
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        assert _slabio.write_blocks(fd, 0, block, 8192, 1, 0) == [checksum(block[0])]
    finally:
        os.close(fd)
