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


@pytest.mark.parametrize("length,stride,per_call,piece", [
    (1000, 4096, 2, 0),                 # small blocks, runs of 2
    (3000, 4096, 1, 700),               # in pieces
    (1 << 20, 1 << 20, 1, 0),           # a 1 MiB block whole, as the tier writes it
])
def test_headers_get_their_checksums_and_land_after_the_payloads(tmp_path, length, stride,
                                                                  per_call, piece):
    """With a header file and blank headers, each header's checksum field is filled with
    its block's checksum (kvstore.layout's header, read back by decode_header) and the
    headers are written at slot * 64, nothing else of the header file touched."""
    from kvstore.keys import Namespace, hash_blocks
    from kvstore.layout import HEADER_BYTES, HeaderEncoder, decode_header
    ns = Namespace("h", num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=4)
    hashes = hash_blocks(ns, list(range(12)))
    n, first = 3, 2
    slabs, heads_path = tmp_path / "slabs", tmp_path / "headers"
    slabs.write_bytes(bytes((first + n) * stride))
    heads_path.write_bytes(b"\xab" * ((first + n + 1) * HEADER_BYTES))
    fd, hfd = os.open(slabs, os.O_RDWR), os.open(heads_path, os.O_RDWR)
    try:
        blocks = _blocks(n, length, seed=7)
        blanks = HeaderEncoder(ns).blanks(hashes)
        sums = _slabio.write_blocks(fd, first * stride, blocks, stride, per_call, piece, hfd,
                                    blanks)
        assert sums == [checksum(b) for b in blocks]
        raw = heads_path.read_bytes()
        assert raw[:first * HEADER_BYTES] == b"\xab" * (first * HEADER_BYTES)
        assert raw[(first + n) * HEADER_BYTES:] == b"\xab" * HEADER_BYTES
        for i in range(n):
            at = (first + i) * HEADER_BYTES
            hdr = decode_header(raw[at:at + HEADER_BYTES])
            assert (hdr.block_hash, hdr.checksum) == (bytes(hashes[i]), sums[i])
            assert raw[at:at + HEADER_BYTES] == HeaderEncoder(ns)(bytes(hashes[i]), sums[i])
    finally:
        os.close(fd)
        os.close(hfd)


def test_no_header_is_written_when_a_payload_is_refused_or_the_headers_are_wrong(tmp_path):
    """A payload write the kernel refuses leaves the header file as it was (a header never
    vouches for bytes not written); headers of the wrong size, or an offset inside a slot,
    are refused before any I/O."""
    slabs, heads_path = tmp_path / "slabs", tmp_path / "headers"
    slabs.write_bytes(bytes(4 * 4096))
    heads_path.write_bytes(b"\xab" * 4 * 64)
    blocks = _blocks(2, 1000, seed=8)
    hfd = os.open(heads_path, os.O_RDWR)
    try:
        fd = os.open(slabs, os.O_RDONLY)  # every payload write fails: EBADF
        try:
            with pytest.raises(OSError) as e:
                _slabio.write_blocks(fd, 0, blocks, 4096, 1, 0, hfd, bytearray(128))
            assert e.value.errno == errno.EBADF
        finally:
            os.close(fd)
        fd = os.open(slabs, os.O_RDWR)
        try:
            with pytest.raises(ValueError, match="bytes of headers for 2 blocks"):
                _slabio.write_blocks(fd, 0, blocks, 4096, 1, 0, hfd, bytearray(64))
            with pytest.raises(ValueError, match="slot's start"):
                _slabio.write_blocks(fd, 100, blocks, 4096, 1, 0, hfd, bytearray(128))
            with pytest.raises((BufferError, TypeError)):  # the checksums are filled in
                _slabio.write_blocks(fd, 0, blocks, 4096, 1, 0, hfd, bytes(128))
        finally:
            os.close(fd)
        assert heads_path.read_bytes() == b"\xab" * 4 * 64
        assert slabs.read_bytes() == bytes(4 * 4096)
    finally:
        os.close(hfd)
