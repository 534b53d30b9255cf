"""The torch reference against a dense oracle (materialised K/V, explicit masked softmax)."""
from __future__ import annotations

import math

import pytest
import torch

from kernels import cache as kv_cache_mod
from kernels import ref
from kernels_testlib import (
    assert_close,
    cu_seqlens,
    make_paged_case,
    oracle_decode,
    oracle_prefill,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens,kv_heads,group,head_dim,block_tokens",
    [
        ([1], 1, 1, 64, 16),  # context length 1
        ([17, 5, 32, 1], 2, 4, 64, 16),  # lengths ending mid-block, GQA 4
        ([40, 9], 1, 8, 128, 16),  # GQA 8, head_dim 128
        ([23, 8, 15], 4, 1, 64, 8),  # MHA, small blocks
        ([7, 30], 2, 2, 32, 5),  # block size not a power of two
    ],
)
def test_decode_matches_dense(dtype, seq_lens, kv_heads, group, head_dim, block_tokens):
    case = make_paged_case(seq_lens, kv_heads, head_dim, block_tokens, dtype, seed=len(seq_lens))
    query = torch.randn(len(seq_lens), kv_heads * group, head_dim).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    out = ref.paged_decode_attention(query, case.layer_cache, case.block_tables, case.seq_lens)
    assert out.shape == query.shape and out.dtype == dtype
    assert_close(out, oracle_decode(case, query, scale))


def test_decode_shared_block_across_sequences():
    case = make_paged_case([20, 16, 3], 2, 32, 16, share_first_block=True)
    assert int(case.block_tables[0, 0]) == int(case.block_tables[1, 0]) == int(case.block_tables[2, 0])
    query = torch.randn(3, 4, 32)
    out = ref.paged_decode_attention(query, case.layer_cache, case.block_tables, case.seq_lens, scale=0.3)
    assert_close(out, oracle_decode(case, query, 0.3))


@pytest.mark.parametrize("num_splits", [2, 3, 8, 64])
def test_decode_split_k_equals_unsplit(num_splits):
    case = make_paged_case([50, 3, 33], 2, 32, 8, seed=3)
    query = torch.randn(3, 8, 32)
    args = (query, case.layer_cache, case.block_tables, case.seq_lens)
    whole = ref.paged_decode_attention(*args, num_splits=1)
    split = ref.paged_decode_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_decode_writes_into_out():
    case = make_paged_case([9, 4], 1, 16, 4)
    query = torch.randn(2, 2, 16)
    out = torch.empty_like(query)
    got = ref.paged_decode_attention(query, case.layer_cache, case.block_tables, case.seq_lens, out=out)
    assert got is out
    assert_close(out, oracle_decode(case, query, 0.25))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens,q_lens,kv_heads,group,head_dim,block_tokens",
    [
        ([1], [1], 1, 1, 64, 16),
        ([37, 16, 9], [5, 16, 1], 2, 4, 64, 16),  # prefix hit, full prefill, decode-like
        ([20, 33], [20, 7], 1, 8, 128, 8),
        ([12, 30, 4], [0, 3, 4], 2, 2, 32, 5),  # an empty chunk in the batch
    ],
)
def test_prefill_matches_dense(dtype, seq_lens, q_lens, kv_heads, group, head_dim, block_tokens):
    case = make_paged_case(seq_lens, kv_heads, head_dim, block_tokens, dtype, seed=sum(q_lens))
    query = torch.randn(sum(q_lens), kv_heads * group, head_dim).to(dtype)
    out = ref.paged_prefill_attention(query, case.layer_cache, case.block_tables, cu_seqlens(q_lens), case.seq_lens)
    assert out.shape == query.shape
    assert_close(out, oracle_prefill(case, query, q_lens, 1 / math.sqrt(head_dim)))


def test_prefill_of_one_token_equals_decode():
    case = make_paged_case([19, 7, 40], 2, 32, 8, seed=5)
    query = torch.randn(3, 4, 32)
    pre = ref.paged_prefill_attention(query, case.layer_cache, case.block_tables, cu_seqlens([1, 1, 1]), case.seq_lens)
    dec = ref.paged_decode_attention(query, case.layer_cache, case.block_tables, case.seq_lens)
    torch.testing.assert_close(pre, dec, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_to_cache_places_tokens_in_slots(dtype):
    cache = torch.zeros(6, 2, 4, 2, 8, dtype=dtype)
    key = torch.randn(5, 2, 8).to(dtype)
    value = torch.randn(5, 2, 8).to(dtype)
    slots = torch.tensor([13, 0, -1, 22, 7])  # block 3 off 1, block 0 off 0, pad, block 5 off 2, block 1 off 3
    ref.write_kv_to_cache(key, value, cache, slots)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(cache[s // 4, 0, s % 4], key[i])
            assert torch.equal(cache[s // 4, 1, s % 4], value[i])
    assert int((cache != 0).any(-1).any(-1).sum()) == 2 * 4  # nothing else written


def test_write_kv_into_a_layer_view_leaves_other_layers():
    full = kv_cache_mod.allocate_kv_cache(4, 3, 4, 2, 8, dtype=torch.float32)
    layer = kv_cache_mod.layer_view(full, 1)
    key, value = torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0)
    ref.write_kv_to_cache(key, value, layer, torch.tensor([5, 14]))
    assert torch.equal(full[1, 1, 0, 1], key[0]) and torch.equal(full[3, 1, 1, 2], value[1])
    assert not full[:, 0].any() and not full[:, 2].any()


def test_gather_then_scatter_round_trips_in_store_layout():
    full = torch.randn(7, 3, 2, 4, 2, 8)  # [num_blocks, L, 2, bt, Hkv, D]
    ids = torch.tensor([5, 0, 3], dtype=torch.int32)
    staged = ref.gather_blocks(full, ids)
    assert staged.shape == (3, 3, 2, 4, 2, 8) and staged.is_contiguous()
    for i, b in enumerate(ids.tolist()):
        assert torch.equal(staged[i], full[b])  # the store's [L, 2, bt, Hkv, D] block payload
    target = torch.zeros_like(full)
    ref.scatter_blocks(staged, target, torch.tensor([1, 6, 2]))
    assert torch.equal(target[1], full[5]) and torch.equal(target[6], full[0]) and torch.equal(target[2], full[3])
    assert not target[[0, 3, 4, 5]].any()


def test_gather_into_preallocated_staging():
    full = torch.randn(4, 2, 2, 2, 1, 4)
    out = torch.empty(2, 2, 2, 2, 1, 4)
    got = ref.gather_blocks(full, torch.tensor([3, 1]), out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out[0], full[3])


@pytest.mark.parametrize("window", [1, 5, 16, 39, 1000])
def test_sliding_window_decode_and_prefill_match_dense(window):
    """A query at p sees keys (p - W, p]: one key, part of a block, whole blocks, all."""
    case = make_paged_case([40, 17, 3], 2, 16, 8, seed=11)
    scale = 0.25
    query = torch.randn(3, 4, 16)
    args = (case.layer_cache, case.block_tables, case.seq_lens)
    assert_close(ref.paged_decode_attention(query, *args, scale=scale, sliding_window=window),
                 oracle_decode(case, query, scale, window))
    assert_close(ref.paged_decode_attention(query, *args, scale=scale, sliding_window=window, num_splits=3),
                 oracle_decode(case, query, scale, window))
    q_lens = [40, 5, 3]  # a whole prefill, a chunk after a cached prefix, a whole short one
    query = torch.randn(sum(q_lens), 4, 16)
    got = ref.paged_prefill_attention(query, case.layer_cache, case.block_tables, cu_seqlens(q_lens),
                                      case.seq_lens, scale, sliding_window=window)
    assert_close(got, oracle_prefill(case, query, q_lens, scale, window))


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_a_bad_sliding_window_is_refused(window):
    case = make_paged_case([4], 1, 8, 4)
    with pytest.raises(ValueError, match="sliding_window"):
        ref.paged_decode_attention(torch.randn(1, 1, 8), case.layer_cache, case.block_tables,
                                   case.seq_lens, sliding_window=window)
