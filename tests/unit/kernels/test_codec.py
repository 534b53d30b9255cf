"""The int8 / fp8_e4m3 block codecs: the reference's bounds and layout, and the Triton
kernels bit-for-bit against it (tiny shapes: on CPU they run interpreted)."""
from __future__ import annotations

import pytest
import torch

from kernels import codec as ref
from kernels.errors import KernelInputError, KernelShapeError

SHAPE = (2, 2, 4, 3, 16)  # [L, 2, bt, Hkv, D]
CODECS = ["int8", "fp8_e4m3"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _blocks(n=3, shape=SHAPE, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=g) * torch.rand((n, *shape[:-1], 1), generator=g) * 8
    x[0, 0, 0, 0, 0] = 0.0                    # a zero vector codes as zeros
    x[0, 0, 1, 0, 0, 0] = 40.0                # one outlier sets only its own row's scale
    return x.to(dtype)


def _roundtrip(x, codec, ids=None):
    enc = ref.encode_blocks(x, codec)
    out = torch.full_like(x, float("nan"))
    ids = torch.arange(x.shape[0]) if ids is None else ids
    ref.decode_blocks(enc, codec, out, ids)
    return enc, out


def test_encoded_size_is_one_byte_a_value_plus_an_fp16_scale_a_row():
    enc = ref.encode_blocks(_blocks(), "int8")
    assert enc.shape == (3, 2 * 2 * 4 * 3 * (16 + 2)) == (3, ref.encoded_bytes(SHAPE)) and enc.dtype == torch.uint8


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_error_is_at_most_half_a_step_of_each_rows_own_scale(dtype):
    x = _blocks(dtype=dtype)
    enc, out = _roundtrip(x, "int8")
    values, scales = ref.encoded_views(enc, SHAPE)
    amax = x.float().abs().amax(-1)
    nearest = (amax / 127).clamp(ref.SCALE_MIN, 65504).half()  # or one fp16 up, if short
    up = (nearest.view(torch.int16) + 1).view(torch.float16)
    assert torch.equal(scales, torch.where(nearest.float() * 127 < amax, up, nearest))
    step = scales.float().unsqueeze(-1)
    slack = 0 if dtype == torch.float32 else out.float().abs() * 2 ** -7  # output rounding
    assert ((out.float() - x.float()).abs() <= step / 2 * (1 + 1e-6) + slack).all()
    assert values.abs().max() <= 127 and torch.equal(out[0, 0, 0, 0, 0], torch.zeros(16, dtype=dtype))


def test_int8_rounds_half_to_even_against_the_stored_scale():
    x = torch.zeros((1, *SHAPE))
    x[0, 0, 0, 0, 0, :3] = torch.tensor([127.0, 2.5, 3.5])  # scale exactly 1.0
    values, _ = ref.encoded_views(ref.encode_blocks(x, "int8"), SHAPE)
    assert values[0, 0, 0, 0, 0, :3].tolist() == [127, 2, 4]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_decodes_exactly_what_torchs_own_fp8_conversion_gives(dtype):
    x = _blocks(dtype=dtype)
    enc, out = _roundtrip(x, "fp8_e4m3")
    values, scales = ref.encoded_views(enc, SHAPE)
    expect = values.view(torch.float8_e4m3fn).float() * scales.float().unsqueeze(-1)
    assert torch.equal(out, expect.to(dtype))
    rel = (out.float() - x.float()).abs() / x.float().abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert rel.max() <= 2 ** -4 + 2 ** -7  # 3 mantissa bits: half an ulp of 448 is 16/448


def test_fp8_bit_decoder_covers_every_byte():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    codes = codes[(codes != 127) & (codes != -1)]  # the two NaN codes are never emitted
    got = torch.empty(codes.shape)
    ref._fp8_bits_to_f32(codes, got)
    assert torch.equal(got * ref.FP8_DECODE_BIAS, codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("codec,limit", [("int8", 127 * 65504.0), ("fp8_e4m3", 448 * 128.0)])
def test_huge_values_saturate_instead_of_turning_inf(codec, limit):
    x = torch.ones((1, *SHAPE))
    x[0, 0, 0, 0, 0, 0] = 1e9
    _, out = _roundtrip(x, codec)
    assert torch.isfinite(out).all() and out[0, 0, 0, 0, 0, 0] == pytest.approx(limit, rel=0.01)


@pytest.mark.parametrize("path", ["cpu", "torch"])
@pytest.mark.parametrize("codec", CODECS)
def test_float16s_largest_values_decode_finite(codec, path):
    """65504 / 127 rounds *up* to an fp16 scale of 516, and 127 x 516 = 65532 is inf in
    float16: the decoder saturates at the destination's range instead."""
    x = torch.zeros((1, *SHAPE), dtype=torch.float16)
    x[0, 0, 0, 0, 0, :2] = torch.tensor([65504.0, -65504.0])
    enc = ref.encode_blocks(x, codec)
    out = torch.zeros_like(x)
    if path == "cpu":
        ref.decode_blocks(enc, codec, out, torch.tensor([0]))
    else:
        ref.decode_torch(*ref.encoded_views(enc, SHAPE), codec, out)
    assert torch.isfinite(out).all()
    top = min(65504.0, ref.SPECS[codec].qmax * ref.SPECS[codec].scale_max)  # fp8: 448 x 128
    assert out[0, 0, 0, 0, 0, :2].tolist() == pytest.approx([top, -top], rel=0.01)


@pytest.mark.parametrize("codec", CODECS)
def test_decode_writes_block_i_into_cache_block_ids_i_and_nothing_else(codec):
    x = _blocks(n=3)
    enc = ref.encode_blocks(x, codec)
    cache = torch.full((6, *SHAPE), 7.0)
    ids = torch.tensor([4, 0, 1])  # one run of two plus a lone block
    ref.decode_blocks(enc, codec, cache, ids)
    _, whole = _roundtrip(x, codec)
    assert torch.equal(cache[ids], whole)
    assert (cache[[2, 3, 5]] == 7.0).all()


def test_bad_inputs_raise_kernel_errors():
    x = _blocks()
    with pytest.raises(KernelInputError, match="not a quantizing codec"):
        ref.encode_blocks(x, "zstd")
    with pytest.raises(KernelShapeError, match="contiguous"):
        ref.encode_blocks(x.transpose(1, 2), "int8")
    enc = ref.encode_blocks(x, "int8")
    with pytest.raises(KernelShapeError, match="uint8 tensor of shape"):
        ref.decode_blocks(enc[:, 1:], "int8", torch.empty_like(x), torch.arange(3))
    with pytest.raises(KernelShapeError, match="uint8 tensor of shape"):
        ref.decode_blocks(enc, "int8", torch.empty_like(x), torch.arange(2))


# ---------------------------------------------------------------- Triton against the reference


@pytest.mark.triton_interp
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [SHAPE, (1, 2, 3, 2, 12)])  # head_dim not a power of two
def test_triton_codec_is_bit_exact_with_the_reference(triton_device, codec, dtype, shape):
    kt = pytest.importorskip("kernels.triton")
    x = _blocks(n=2, shape=shape, dtype=dtype, seed=3)
    x[1, 0, 0, 0, 0, :4] = torch.tensor([2 ** -12, -2 ** -9, 0.0, -0.0]).to(dtype)  # fp8 subnormals
    x[1, 0, 1, 0, 0, :2] = torch.tensor([65504.0, -65504.0]).to(dtype)  # fp16's edge: saturates
    expect = ref.encode_blocks(x, codec)
    got = kt.encode_blocks(x.to(triton_device), codec)
    assert torch.equal(got.cpu(), expect)
    cache = torch.zeros((4, *shape), dtype=dtype)
    ids = torch.tensor([3, 1])
    ref.decode_blocks(expect, codec, cache, ids)
    cache_t = torch.zeros((4, *shape), dtype=dtype, device=triton_device)
    kt.decode_blocks(got, codec, cache_t, ids.to(triton_device))
    _assert_same_decode(cache_t.cpu(), cache, triton_device)


def _assert_same_decode(got, expect, device):
    if expect.dtype == torch.bfloat16 and device == "cpu":
        # Triton 3.7.1's interpreter truncates fp32 -> bf16 (compiled kernels round to
        # nearest even, as torch does): there, up to one bf16 ulp apart
        ulp = expect.float().abs() * 2 ** -7
        assert ((got.float() - expect.float()).abs() <= ulp).all()
        return
    assert torch.equal(got, expect)


@pytest.mark.triton_interp
def test_triton_fp8_rounds_where_the_carry_reaches_the_exponent(triton_device):
    kt = pytest.importorskip("kernels.triton")
    x = torch.zeros((1, *SHAPE))
    # scale 1.0 (row amax 448): 31.81 and 0.4873 round up into the next binade, 7.5 ties to 8
    x[0, 0, 0, 0, 0, :5] = torch.tensor([448.0, 31.81, 0.4873, -7.5, 9.0])
    assert torch.equal(kt.encode_blocks(x.to(triton_device), "fp8_e4m3").cpu(),
                       ref.encode_blocks(x, "fp8_e4m3"))


# ---------------------------------------------------------------- the CPU path (numpy)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cpu_path_is_bit_exact_with_the_torch_definition(codec, dtype):
    x = _blocks(n=3, dtype=dtype, seed=5)
    x[1, 0, 0, 0, 0, :6] = torch.tensor([2 ** -12, -2 ** -9, 0.0, -0.0, 1e-3, -3e-4]).to(dtype)
    x[2, 1, 1, 1, 1, :4] = torch.tensor([448.0, 31.81, 0.4873, -7.5]).to(dtype)  # carries, ties
    cpu = ref.encode_blocks(x, codec)                    # CPU tensors take kernels.codec_cpu
    want = torch.empty_like(cpu)
    values, scales = ref.encoded_views(want, SHAPE)
    ref.encode_torch(x, values, scales, codec, ref.SPECS[codec])
    assert torch.equal(cpu, want)
    got, expect = torch.zeros_like(x), torch.zeros_like(x)
    ref.decode_blocks(cpu, codec, got, torch.arange(3))
    ref.decode_torch(values, scales, codec, expect)
    assert torch.equal(got, expect)


def test_the_cpu_fp8_encoder_matches_torch_on_every_code_and_every_midpoint():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes != 0x7F) & (codes != 0xFF)]
    values = codes.view(torch.float8_e4m3fn).float().unique()       # every finite e4m3 value
    pos = values[values >= 0]
    mids = (pos[1:] + pos[:-1]) / 2                                  # the ties
    probe = torch.cat([values, mids, -mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20)])
    from kernels import codec_cpu
    got = torch.from_numpy(codec_cpu.fp8_e4m3_bytes(probe.numpy()))
    assert torch.equal(got, probe.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("codec", CODECS)
def test_tiny_rows_keep_half_a_step_where_their_scale_is_an_fp16_subnormal(codec):
    """A row of amax ~1e-5 has a scale in fp16's subnormals, where rounding to the nearest
    fp16 can leave it a third short of amax / qmax: its largest values clamped (int8 rows
    of amax 1.12e-5 lost 32%). The scale is rounded up instead where it falls short."""
    x = torch.zeros((1, *SHAPE))
    for i, amax in enumerate([1.12e-5, 1e-5, 4e-5, 3e-6, 7e-3]):
        x[0, 0, 0, i % 4, i % 3, :] = torch.linspace(-amax, amax, 16)
    enc, out = _roundtrip(x, codec)
    _, scales = ref.encoded_views(enc, SHAPE)
    amax = x.abs().amax(-1)
    assert (scales.float() * ref.SPECS[codec].qmax >= amax).all()  # nothing clamps
    step = scales.float().unsqueeze(-1)
    err = (out - x).abs()
    if codec == "int8":  # half a step of the row's own scale
        assert (err <= step / 2 * (1 + 1e-6)).all()
    else:  # half an e4m3 mantissa step (2^-4 of the value), or of its subnormals' 2^-9
        assert (err <= torch.maximum(x.abs() * 2 ** -4, step * 2 ** -10) * (1 + 1e-6)).all()
