"""Hypothesis-drawn shapes: reference vs dense oracle, Triton vs reference (few examples)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import ref
from kernels_testlib import assert_close, cu_seqlens, make_paged_case, oracle_decode, oracle_prefill


@st.composite
def paged_shapes(draw):
    batch = draw(st.integers(1, 4))
    block_tokens = draw(st.sampled_from([1, 3, 4, 16]))
    seq_lens = draw(st.lists(st.integers(1, 48), min_size=batch, max_size=batch))
    q_lens = [draw(st.integers(0, n)) for n in seq_lens]
    return dict(
        seq_lens=seq_lens, q_lens=q_lens, block_tokens=block_tokens,
        kv_heads=draw(st.integers(1, 3)), group=draw(st.sampled_from([1, 2, 4, 8])),
        head_dim=draw(st.sampled_from([8, 16, 24])), seed=draw(st.integers(0, 2**16)),
        share=draw(st.booleans()),
    )


def _build(s, dtype=torch.float32):
    case = make_paged_case(s["seq_lens"], s["kv_heads"], s["head_dim"], s["block_tokens"], dtype,
                           seed=s["seed"], share_first_block=s["share"])
    gen = torch.Generator().manual_seed(s["seed"] + 1)
    heads = s["kv_heads"] * s["group"]
    decode_q = torch.randn(len(s["seq_lens"]), heads, s["head_dim"], generator=gen).to(dtype)
    prefill_q = torch.randn(sum(s["q_lens"]), heads, s["head_dim"], generator=gen).to(dtype)
    return case, decode_q, prefill_q


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_shapes(), st.integers(1, 5))
def test_reference_matches_dense_oracle(s, num_splits):
    case, dq, pq = _build(s)
    scale = 1 / math.sqrt(s["head_dim"])
    out = ref.paged_decode_attention(dq, case.layer_cache, case.block_tables, case.seq_lens, num_splits=num_splits)
    assert_close(out, oracle_decode(case, dq, scale))
    cu = cu_seqlens(s["q_lens"])
    out = ref.paged_prefill_attention(pq, case.layer_cache, case.block_tables, cu, case.seq_lens)
    assert_close(out, oracle_prefill(case, pq, s["q_lens"], scale))


@pytest.mark.triton_interp
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(paged_shapes(), st.sampled_from([None, 1, 2]), st.sampled_from([torch.float32, torch.float16]))
def test_triton_matches_reference(triton_device, s, num_splits, dtype):
    kt = pytest.importorskip("kernels.triton")
    case, dq, pq = _build(s, dtype)
    case = type(case)(*(x.to(triton_device) if isinstance(x, torch.Tensor) else x for x in case))
    dq, pq, cu = dq.to(triton_device), pq.to(triton_device), cu_seqlens(s["q_lens"]).to(triton_device)
    args = (dq, case.layer_cache, case.block_tables, case.seq_lens)
    assert_close(kt.paged_decode_attention(*args, num_splits=num_splits).cpu(), ref.paged_decode_attention(*args).cpu())
    args = (pq, case.layer_cache, case.block_tables, cu, case.seq_lens)
    assert_close(kt.paged_prefill_attention(*args).cpu(), ref.paged_prefill_attention(*args).cpu())
