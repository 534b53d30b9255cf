"""Triton kernels against the torch reference (tiny shapes: on CPU they run interpreted)."""
from __future__ import annotations

import pytest
import torch

from kernels import ref
from kernels_testlib import TOL, cu_seqlens, make_paged_case

pytestmark = pytest.mark.triton_interp
kt = pytest.importorskip("kernels.triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _to(case, device):
    return type(case)(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in case))


def _close(actual, expected):
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), **TOL[expected.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens,kv_heads,group,head_dim,block_tokens",
    [
        ([1, 17, 40], 2, 4, 32, 8),  # length 1, mid-block ends, GQA 4
        ([9, 33], 1, 8, 64, 16),  # GQA 8
        ([23, 5], 2, 1, 16, 5),  # MHA, block size not a power of two
        ([12], 1, 2, 24, 4),  # head_dim not a power of two
    ],
)
def test_decode_matches_reference(triton_device, dtype, seq_lens, kv_heads, group, head_dim, block_tokens):
    case = _to(make_paged_case(seq_lens, kv_heads, head_dim, block_tokens, dtype, seed=7), triton_device)
    query = torch.randn(len(seq_lens), kv_heads * group, head_dim).to(dtype).to(triton_device)
    args = (query, case.layer_cache, case.block_tables, case.seq_lens)
    expected = ref.paged_decode_attention(*args)
    _close(kt.paged_decode_attention(*args, num_splits=1), expected)
    _close(kt.paged_decode_attention(*args, num_splits=3), expected)


def test_decode_split_k_equals_unsplit_and_auto(triton_device):
    case = _to(make_paged_case([70, 3], 1, 16, 8, seed=2), triton_device)
    query = torch.randn(2, 2, 16, device=triton_device)
    args = (query, case.layer_cache, case.block_tables, case.seq_lens)
    whole = kt.paged_decode_attention(*args, num_splits=1)
    for splits in (2, 4, None):  # None: the heuristic (splits on a small batch)
        torch.testing.assert_close(kt.paged_decode_attention(*args, num_splits=splits), whole, atol=1e-5, rtol=1e-5)
    from kernels.triton.decode import choose_num_splits

    assert choose_num_splits(1, 1, 4096, torch.device("cpu")) > 1  # the split path is the auto one here


def test_decode_shared_first_block_and_out(triton_device):
    case = _to(make_paged_case([20, 16, 3], 2, 16, 16, share_first_block=True), triton_device)
    query = torch.randn(3, 4, 16, device=triton_device)
    out = torch.empty_like(query)
    args = (query, case.layer_cache, case.block_tables, case.seq_lens)
    got = kt.paged_decode_attention(*args, scale=0.2, out=out)
    assert got is out
    _close(out, ref.paged_decode_attention(*args, scale=0.2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens,q_lens,kv_heads,group,head_dim,block_tokens",
    [
        ([37, 16, 9], [5, 16, 1], 2, 2, 32, 8),  # prefix hit, whole prefill, decode-like
        ([45, 6], [40, 0], 1, 4, 16, 16),  # > one query tile; an empty chunk
        ([13], [13], 2, 1, 24, 5),  # odd block size and head_dim
    ],
)
def test_prefill_matches_reference(triton_device, dtype, seq_lens, q_lens, kv_heads, group, head_dim, block_tokens):
    case = _to(make_paged_case(seq_lens, kv_heads, head_dim, block_tokens, dtype, seed=4), triton_device)
    query = torch.randn(sum(q_lens), kv_heads * group, head_dim).to(dtype).to(triton_device)
    cu = cu_seqlens(q_lens).to(triton_device)
    args = (query, case.layer_cache, case.block_tables, cu, case.seq_lens)
    _close(kt.paged_prefill_attention(*args), ref.paged_prefill_attention(*args))
    _close(kt.paged_prefill_attention(*args, max_query_len=max(q_lens)), ref.paged_prefill_attention(*args))


@pytest.mark.parametrize("window", [1, 7, 32, 45])
def test_sliding_window_matches_reference(triton_device, window):
    """Windows inside a block, across a key step (32), of the whole context; prefill tiles
    whose first rows see no key in a step; decode splits wholly before the window."""
    case = _to(make_paged_case([70, 37, 9], 2, 16, 8, seed=5), triton_device)
    query = torch.randn(3, 4, 16).to(triton_device)
    args = (case.layer_cache, case.block_tables, case.seq_lens)
    expected = ref.paged_decode_attention(query, *args, sliding_window=window)
    for splits in (1, 3):
        _close(kt.paged_decode_attention(query, *args, num_splits=splits, sliding_window=window), expected)
    q_lens = [70, 5, 9]
    query = torch.randn(sum(q_lens), 4, 16).to(triton_device)
    pargs = (query, case.layer_cache, case.block_tables, cu_seqlens(q_lens).to(triton_device), case.seq_lens)
    got = kt.paged_prefill_attention(*pargs, sliding_window=window)
    assert not torch.isnan(got).any()
    _close(got, ref.paged_prefill_attention(*pargs, sliding_window=window))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference(triton_device, dtype):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(5, 2, 2, 4, 3, 8, generator=gen).to(dtype).to(triton_device)  # [nb, L, 2, bt, Hkv, D]
    key = torch.randn(6, 3, 8, generator=gen).to(dtype).to(triton_device)
    value = torch.randn(6, 3, 8, generator=gen).to(dtype).to(triton_device)
    slots = torch.tensor([19, 0, -1, 7, 12, 3], device=triton_device)
    expected = full.clone()
    ref.write_kv_to_cache(key, value, expected[:, 1], slots)
    kt.write_kv_to_cache(key, value, full[:, 1], slots)
    assert torch.equal(full, expected)


def test_gather_scatter_match_reference(triton_device):
    full = torch.randn(9, 2, 2, 4, 2, 8, device=triton_device).half()
    ids = torch.tensor([8, 0, 4, 5], dtype=torch.int32, device=triton_device)
    staged = kt.gather_blocks(full, ids)
    assert torch.equal(staged, ref.gather_blocks(full, ids))
    out = torch.empty_like(staged)
    assert kt.gather_blocks(full, ids, out=out) is out and torch.equal(out, staged)
    target, expected = torch.zeros_like(full), torch.zeros_like(full)
    back = torch.tensor([1, 2, 7, 3], device=triton_device)
    kt.scatter_blocks(staged, target, back)
    ref.scatter_blocks(staged, expected, back)
    assert torch.equal(target, expected)


def test_empty_batches_are_no_ops(triton_device):
    full = torch.zeros(3, 1, 2, 4, 1, 8, device=triton_device)
    ids = torch.zeros(0, dtype=torch.int64, device=triton_device)
    assert kt.gather_blocks(full, ids).shape == (0, 1, 2, 4, 1, 8)
    kt.scatter_blocks(full[:0], full, ids)
    empty = torch.zeros(0, 1, 8, device=triton_device)
    kt.write_kv_to_cache(empty, empty, full[:, 0], ids)
    assert not full.any()
