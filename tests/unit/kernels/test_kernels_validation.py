"""Bad input raises a clear KernelInputError from every backend, before any kernel runs."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import ref
from kernels.errors import (
    KernelDeviceError,
    KernelDTypeError,
    KernelIndexError,
    KernelInputError,
    KernelShapeError,
)
from kernels_testlib import cu_seqlens, make_paged_case

BACKENDS = ["ref", pytest.param("triton", marks=pytest.mark.triton_interp)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "ref":
        return ref
    return pytest.importorskip("kernels.triton")


def _decode_args():
    case = make_paged_case([9, 4], 2, 8, 4, seed=1)  # tables [2, 4]: up to 16 tokens
    query = torch.randn(2, 4, 8)
    return dict(query=query, layer_cache=case.layer_cache, block_tables=case.block_tables, seq_lens=case.seq_lens)


DECODE_CASES = {
    "query rank": (lambda a: a.update(query=a["query"][0]), KernelShapeError, "query must be"),
    "query dtype vs cache": (lambda a: a.update(query=a["query"].half()), KernelDTypeError, "!= kv cache dtype"),
    "int query": (lambda a: a.update(query=a["query"].int()), KernelDTypeError, "dtype torch.int32"),
    "heads not a multiple": (lambda a: a.update(query=torch.randn(2, 3, 8)), KernelShapeError, "multiple of num_kv_heads"),
    "head_dim": (lambda a: a.update(query=torch.randn(2, 4, 16)), KernelShapeError, "head_dim 16"),
    "strided query": (lambda a: a.update(query=torch.randn(4, 2, 8).transpose(0, 1)), KernelShapeError, "contiguous"),
    "cache inner strides": (
        lambda a: a.update(layer_cache=a["layer_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
        KernelShapeError, "inner dims"),
    "cache rank": (lambda a: a.update(layer_cache=a["layer_cache"][0]), KernelShapeError, "num_blocks, 2"),
    "table dtype": (lambda a: a.update(block_tables=a["block_tables"].float()), KernelDTypeError, "block_tables"),
    "table rows": (lambda a: a.update(block_tables=a["block_tables"][:1]), KernelShapeError, "block_tables has 1 rows"),
    "block id out of range": (lambda a: a["block_tables"].__setitem__((0, 2), 99), KernelIndexError, "block_tables[0, 2] = 99"),
    "negative block id": (lambda a: a["block_tables"].__setitem__((1, 0), -1), KernelIndexError, "block_tables[1, 0] = -1"),
    "context too long": (lambda a: a["seq_lens"].__setitem__(0, 17), KernelIndexError, "holds 4 per sequence"),
    "empty context": (lambda a: a["seq_lens"].__setitem__(1, 0), KernelIndexError, "seq_lens must be >= 1"),
    "device": (lambda a: a.update(seq_lens=a["seq_lens"].to("meta")), KernelDeviceError, "different devices"),
    "num_splits": (lambda a: a.update(num_splits=0), KernelInputError, "num_splits"),
    "scale": (lambda a: a.update(scale=-1.0), KernelInputError, "scale"),
    "out shape": (lambda a: a.update(out=torch.empty(2, 4, 4)), KernelShapeError, "out shape"),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_rejects(backend, name):
    args = _decode_args()
    mutate, exc, words = DECODE_CASES[name]
    mutate(args)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        backend.paged_decode_attention(**args)


def test_unused_table_entries_may_hold_anything(backend):
    args = _decode_args()
    args["block_tables"][1, 1:] = -7  # seq 1 has 4 tokens = 1 block; the rest is padding
    assert backend.paged_decode_attention(**args).shape == (2, 4, 8)


def _prefill_args(q_lens=(3, 4)):
    case = make_paged_case([9, 4], 2, 8, 4, seed=1)
    return dict(query=torch.randn(sum(q_lens), 4, 8), layer_cache=case.layer_cache, block_tables=case.block_tables,
                cu_seqlens_q=cu_seqlens(list(q_lens)), seq_lens=case.seq_lens)


PREFILL_CASES = {
    "cu_seqlens length": (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:2]), KernelShapeError, "batch \\+ 1"),
    "cu_seqlens end": (lambda a: a.update(query=torch.randn(8, 4, 8)), KernelIndexError, "end at the number"),
    "cu_seqlens decreasing": (lambda a: a["cu_seqlens_q"].__setitem__(1, 9), KernelIndexError, "non-decreasing"),
    "chunk longer than context": (lambda a: a["seq_lens"].__setitem__(1, 3), KernelIndexError, "4 new query tokens"),
    "heads not a multiple": (lambda a: a.update(query=torch.randn(7, 5, 8)), KernelShapeError, "multiple"),
    "context too long": (lambda a: a["seq_lens"].__setitem__(0, 30), KernelIndexError, "needs 8 blocks"),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_rejects(backend, name):
    args = _prefill_args()
    mutate, exc, words = PREFILL_CASES[name]
    mutate(args)
    with pytest.raises(exc, match=words):
        backend.paged_prefill_attention(**args)


WRITE_CASES = {
    "slot past the cache": (lambda a: a["slot_mapping"].__setitem__(0, 24), KernelIndexError, "has 24 slots"),
    "slot below -1": (lambda a: a["slot_mapping"].__setitem__(1, -2), KernelIndexError, "-1 for padding"),
    "slot count": (lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), KernelShapeError, "one slot per token"),
    "key shape": (lambda a: a.update(key=torch.randn(3, 2, 4)), KernelShapeError, "key must be"),
    "value dtype": (lambda a: a.update(value=a["value"].bfloat16()), KernelDTypeError, "value dtype"),
    "slot dtype": (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), KernelDTypeError, "slot_mapping"),
}


@pytest.mark.parametrize("name", list(WRITE_CASES))
def test_write_kv_rejects_and_writes_nothing(backend, name):
    cache = torch.zeros(6, 2, 4, 2, 8)  # 24 slots
    args = dict(key=torch.randn(3, 2, 8), value=torch.randn(3, 2, 8), layer_cache=cache,
                slot_mapping=torch.tensor([0, 5, 9]))
    mutate, exc, words = WRITE_CASES[name]
    mutate(args)
    with pytest.raises(exc, match=words):
        backend.write_kv_to_cache(**args)
    assert not cache.any()


def test_gather_scatter_reject(backend):
    cache = torch.zeros(4, 2, 2, 4, 1, 8)
    with pytest.raises(KernelIndexError, match="block_ids must be in"):
        backend.gather_blocks(cache, torch.tensor([0, 4]))
    with pytest.raises(KernelShapeError, match="staging buffer must be"):
        backend.gather_blocks(cache, torch.tensor([0, 1]), out=torch.empty(2, 2, 2, 4, 1, 4))
    staging = torch.ones(2, 2, 2, 4, 1, 8)
    with pytest.raises(KernelIndexError, match="distinct"):
        backend.scatter_blocks(staging, cache, torch.tensor([1, 1]))
    with pytest.raises(KernelDTypeError, match="staging dtype"):
        backend.scatter_blocks(staging.half(), cache, torch.tensor([1, 2]))
    with pytest.raises(KernelShapeError, match="kv cache must be"):
        backend.gather_blocks(cache[:, 0], torch.tensor([1]))
    assert not cache.any()


def test_errors_are_value_and_type_errors():
    assert issubclass(KernelIndexError, ValueError) and issubclass(KernelDTypeError, TypeError)
    assert kernels.KernelInputError is KernelInputError


@pytest.mark.triton_interp
def test_triton_refuses_cpu_tensors_without_interpreter(monkeypatch):
    kt = pytest.importorskip("kernels.triton")
    from kernels.triton import common

    monkeypatch.setattr(common, "INTERPRETING", False)
    with pytest.raises(KernelDeviceError, match="TRITON_INTERPRET=1"):
        kt.gather_blocks(torch.zeros(2, 1, 2, 4, 1, 8), torch.tensor([0]))


def test_check_values_false_skips_value_checks_only():
    args = _decode_args()
    args["block_tables"][1, 0] = -1
    with pytest.raises(KernelShapeError):
        ref.paged_decode_attention(**{**args, "query": torch.randn(2, 4)}, check_values=False)
    ref.paged_decode_attention(**args, check_values=False)  # the ref clamps: no crash


def test_scratch_from_inference_mode_is_not_reused_outside_it():
    import torch
    from kernels import ref
    with torch.inference_mode():
        buf = ref._workspace("t", (4, 4), torch.empty(1))
        assert buf.is_inference()
    outside = ref._workspace("t", (4, 4), torch.empty(1))
    outside.fill_(1.0)  # raised before: "Inplace update to inference tensor outside InferenceMode"
    assert not outside.is_inference()
