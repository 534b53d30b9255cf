"""The cache-bypassing host copy (transfer/_stream.c) against numpy's: every byte where it
belongs whatever the alignment and length, nothing written outside the destination, and
bad arguments refused; copy_bytes and copy_at route through it from STREAM_BYTES up."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer import copy as tc

stream = pytest.importorskip("transfer._stream", reason="transfer._stream is missing: "
                             "reinstall kvtier with a C compiler (pip install -e .)")


def test_every_length_and_alignment_lands_exactly_where_it_should():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    for dst_off in (0, 1, 15, 16, 63, 64, 65):
        for src_off in (0, 3, 64):
            for n in (0, 1, 63, 64, 65, 127, 128, 129, 4095, 4096 + 17):
                dst = np.zeros(n + 256, np.uint8)
                stream.copy(dst[dst_off:dst_off + n], src[src_off:src_off + n])
                assert (dst[dst_off:dst_off + n] == src[src_off:src_off + n]).all()
                assert not dst[:dst_off].any() and not dst[dst_off + n:].any()


def test_by_address_it_copies_the_same_bytes():
    src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[:(1 << 20) + 5]
    dst = np.zeros_like(src)
    stream.copy_at(dst.ctypes.data, src.ctypes.data, len(src))
    assert (dst == src).all()
    with pytest.raises(ValueError, match="negative"):
        stream.copy_at(dst.ctypes.data, src.ctypes.data, -1)


def test_bad_buffers_are_refused_and_nothing_is_written():
    dst = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="100"):
        stream.copy(dst, bytes(99))
    assert not dst.any()
    with pytest.raises(TypeError):  # a read-only destination
        stream.copy(b"x" * 100, dst)
    with pytest.raises((BufferError, TypeError)):  # not contiguous
        stream.copy(np.zeros(200, np.uint8)[::2], bytes(100))


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("nbytes", [tc.STREAM_COLD_BYTES - 1, tc.STREAM_COLD_BYTES,
                                    tc.STREAM_BYTES, 4 << 20])
def test_copy_bytes_moves_host_blocks_exactly_either_way(nbytes, cold):
    """Below its threshold numpy copies, from it on the streaming copy does; torch and numpy
    rows, strided views (which cannot stream) and read-only destinations keep their
    behaviour."""
    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    for dst in (np.zeros(nbytes, np.uint8), torch.zeros(nbytes, dtype=torch.uint8)):
        tc.copy_bytes(dst, src, cold)
        assert (np.asarray(dst) == src).all()
    rows = torch.from_numpy(src.copy()).view(1, nbytes)
    out = np.zeros((1, nbytes), np.uint8)
    tc.copy_bytes(out, rows, cold)
    assert (out[0] == src).all()
    strided = np.zeros(2 * nbytes, np.uint8)[::2]
    tc.copy_bytes(strided, src, cold)
    assert (strided == src).all()
    frozen = np.zeros(nbytes, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        tc.copy_bytes(frozen, src, cold)
    with pytest.raises(TypeError):  # another dtype is not cast, streamed or not
        tc.copy_bytes(np.zeros(nbytes // 2, np.float16), np.zeros(nbytes // 2, np.uint16), cold)


class _Counted:
    def __init__(self) -> None:
        self.calls = 0

    def copy(self, dst, src) -> None:
        self.calls += 1
        stream.copy(dst, src)

    def copy_at(self, dst, src, n) -> None:
        self.calls += 1
        stream.copy_at(dst, src, n)


def test_which_copies_stream(monkeypatch):
    """Copies into slots (`cold`) stream from STREAM_COLD_BYTES, every other from
    STREAM_BYTES: a smaller get into a buffer still in cache runs faster in cache."""
    counted = _Counted()
    monkeypatch.setattr(tc, "_stream", counted)
    for nbytes, cold, streams in ((tc.STREAM_COLD_BYTES, True, True),
                                  (tc.STREAM_COLD_BYTES - 1, True, False),
                                  (tc.STREAM_COLD_BYTES, False, False),
                                  (tc.STREAM_BYTES, False, True)):
        before = counted.calls
        tc.copy_bytes(np.zeros(nbytes, np.uint8), np.ones(nbytes, np.uint8), cold)
        assert (counted.calls > before) == streams, (nbytes, cold)
    src, dst = np.ones(tc.STREAM_BYTES, np.uint8), np.zeros(tc.STREAM_BYTES, np.uint8)
    before = counted.calls
    tc.copy_at(dst.ctypes.data, src.ctypes.data, tc.STREAM_BYTES - 1)
    assert counted.calls == before and dst[:-1].all() and not dst[-1]
    tc.copy_at(dst.ctypes.data, src.ctypes.data, tc.STREAM_BYTES)
    assert counted.calls == before + 1 and dst.all()


def test_the_copy_helpers_use_the_streaming_copy():
    assert tc.STREAMING and tc._stream is stream
    src = np.arange(tc.STREAM_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    tc.copy_at(dst.ctypes.data, src.ctypes.data, len(src))
    assert (dst == src).all()
