"""`host_rows` and `host_address`: the same-host read path's destination, taken only where
it is safe."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.buffers import byte_rows, host_address, host_rows, select_rows
from kvstore.errors import BlockSizeError


@pytest.mark.parametrize("make", [lambda: torch.zeros(3, 8, dtype=torch.uint8),
                                  lambda: torch.zeros(24, dtype=torch.uint8),
                                  lambda: np.zeros((3, 8), np.uint8),
                                  lambda: np.zeros(24, np.uint8)])
def test_host_bytes_become_one_writable_view_of_the_same_memory(make):
    buf = make()
    rows = host_rows(buf, 3, 8)
    assert rows.shape == (3, 8) and rows.dtype == np.uint8
    rows[1] = 7
    flat = buf.reshape(-1) if isinstance(buf, torch.Tensor) else buf.reshape(-1)
    assert list(flat[8:16]) == [7] * 8 and not flat[:8].any() and not flat[16:].any()
    assert torch.equal(torch.from_numpy(rows)[1], torch.full((8,), 7, dtype=torch.uint8))


@pytest.mark.parametrize("buf", [
    torch.zeros(3, 4, dtype=torch.float16),              # not bytes: byte_rows views it
    torch.zeros(3, 8, dtype=torch.uint8, requires_grad=False).t(),  # not contiguous
    torch.zeros(3, 9, dtype=torch.uint8),                # wrong size
    np.zeros((3, 8), np.uint8)[:, ::-1],                 # not contiguous
    np.frombuffer(bytes(24), np.uint8),                  # read-only
    [bytearray(8)] * 3,                                  # one buffer per block
    bytearray(24),
    torch.zeros(3, 8, dtype=torch.float32, requires_grad=True),  # numpy() refuses it
])
def test_anything_else_is_left_to_byte_rows(buf):
    assert host_rows(buf, 3, 8) is None


def test_a_put_takes_read_only_host_bytes_as_they_are():
    buf = np.frombuffer(bytes(range(24)), np.uint8)
    rows = host_rows(buf, 3, 8, writable=False)
    assert rows.shape == (3, 8) and bytes(rows[2]) == bytes(range(16, 24))
    assert np.shares_memory(rows, buf)


def test_select_rows_keeps_a_whole_array_whole_and_picks_rows_otherwise():
    rows = np.arange(24, dtype=np.uint8).reshape(3, 8)
    assert select_rows(rows, range(3)) is rows
    picked = select_rows(rows, [2, 0])
    assert [bytes(r) for r in picked] == [bytes(rows[2]), bytes(rows[0])]


def test_byte_rows_still_explains_what_host_rows_declined():
    with pytest.raises(BlockSizeError, match="24 bytes|27 bytes"):
        byte_rows(torch.zeros(3, 9, dtype=torch.uint8), 3, 8, writable=True)
    with pytest.raises(TypeError, match="read-only"):
        byte_rows(np.frombuffer(bytes(24), np.uint8), 3, 8, writable=True)


def test_a_contiguous_cpu_tensor_of_the_right_size_gives_its_own_address():
    big = torch.zeros(6, 8, dtype=torch.uint8)
    assert host_address(big, 48) == big.data_ptr()
    assert host_address(big[2:5], 24) == big.data_ptr() + 16  # its storage offset counted
    assert host_address(torch.zeros(3, 2, dtype=torch.float32), 24) is not None


@pytest.mark.parametrize("buf", [
    torch.zeros(3, 9, dtype=torch.uint8),                # wrong size
    torch.zeros(8, 3, dtype=torch.uint8).t(),            # not contiguous
    torch.zeros(6, dtype=torch.float32, requires_grad=True),
    torch.zeros(3, dtype=torch.complex64),               # may carry a lazy conjugate
    np.zeros((3, 8), np.uint8),                          # arrays keep host_rows
    bytearray(24),
    [torch.zeros(8, dtype=torch.uint8)] * 3,
])
def test_anything_else_has_no_address(buf):
    assert host_address(buf, 24) is None


@pytest.mark.parametrize("n", [0, 3])
@pytest.mark.parametrize("buf", [None, 5, "abc"])
def test_something_that_is_no_buffer_is_named_in_the_error(buf, n):
    """`get_n([], None)` said "memoryview: a bytes-like object is required": the error now
    says what a block buffer may be and what it got, for an empty batch as for any."""
    with pytest.raises(TypeError, match=f"tensors, numpy arrays or bytes-like.*{type(buf).__name__}"):
        byte_rows(buf, n, 8, writable=True)


def test_a_destination_that_requires_grad_is_refused_and_a_source_is_not():
    """A get wrote into a tensor that requires grad, behind autograd's back (torch itself
    refuses an in-place write into such a leaf); as a put's source it is only read."""
    dst = torch.zeros((2, 16), requires_grad=True)
    with pytest.raises(TypeError, match="requires grad.*detach"):
        byte_rows(dst, 2, 64, writable=True)
    assert host_rows(dst, 2, 64) is None and host_address(dst, 128) is None
    assert byte_rows(dst.detach(), 2, 64, writable=True).shape == (2, 64)
    assert byte_rows(dst, 2, 64).shape == (2, 64)
