"""Quantizing block codecs, torch reference (also the CPU path): int8 and fp8_e4m3.

A block `[num_layers, 2 (K,V), bt, Hkv, D]` of the model's dtype becomes `encoded_bytes`
bytes laid out per layer, so a layer-wise loader can still take one layer's slice:

    per layer:  values [2, bt, Hkv, D] (one byte each) | scales [2, bt, Hkv] (fp16)
    value = q * scale

One scale per token and kv head (the D values of one head of one token share it): a scale
per head over a whole block measured far worse on SmolLM2, because a few tokens (the first,
the attention sinks) carry K/V an order of magnitude above the rest.

    int8       q = round_half_even(x / s), clamped to [-127, 127];  s = fp16(amax / 127)
    fp8_e4m3   q = float8_e4m3fn(x / s), x / s clamped to [-448, 448];  s = fp16(amax / 448)

The scale is rounded to fp16 *before* quantizing, so x is coded against the scale the
decoder will use. It is clamped to [2^-24, SCALE_MAX]: a zero vector codes as zeros, and a
value beyond 127 * 65504 (int8) or 448 * 128 (fp8) saturates instead of becoming inf/NaN
(fp8's lower cap keeps the decoder's scale * 2^120 finite, see `_fp8_bits_to_f32`).

    encode_blocks(blocks [n, L, 2, bt, Hkv, D], codec, out=None) -> uint8 [n, encoded_bytes]
    decode_blocks(encoded [n, encoded_bytes], codec, kv_cache, block_ids)     in place:
        block i decodes into kv_cache[block_ids[i]] (a staging tensor with arange ids works)

The torch ops below define the codec (any device); CPU tensors take `kernels.codec_cpu`,
the same arithmetic in numpy on the calling thread (torch's CPU thread pool spins on a
busy host).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import codec_cpu
from kernels.cache import SUPPORTED_DTYPES
from kernels.errors import KernelDTypeError, KernelInputError, KernelShapeError

CODECS = ("int8", "fp8_e4m3")
SCALE_DTYPE = torch.float16
SCALE_MIN = 2.0 ** -24  # the smallest fp16 (subnormal)


class CodecSpec(NamedTuple):
    qmax: float         # largest |q|
    scale_max: float    # largest scale (fp16-representable)


SPECS = {"int8": CodecSpec(127.0, 65504.0), "fp8_e4m3": CodecSpec(448.0, 128.0)}
FP8_DECODE_BIAS = 2.0 ** 120  # e4m3 bits placed in fp32's exponent field read 2^-120 too small


def encoded_bytes(block_shape: tuple[int, ...]) -> int:
    """Bytes of one encoded block of `block_shape` [L, 2, bt, Hkv, D] (either codec)."""
    layers, kv, tokens, heads, head_dim = block_shape
    return layers * kv * tokens * heads * (head_dim + SCALE_DTYPE.itemsize)


def encoded_views(encoded: torch.Tensor, block_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 [n, L, 2, bt, Hkv, D], scales fp16 [n, L, 2, bt, Hkv]): strided views
    into `encoded` uint8 [n, encoded_bytes]."""
    layers, kv, tokens, heads, head_dim = block_shape
    n, rows = encoded.shape[0], kv * tokens * heads
    per_layer = encoded.view(n, layers, rows * (head_dim + SCALE_DTYPE.itemsize))
    values = per_layer[:, :, :rows * head_dim].view(torch.int8).view(n, layers, kv, tokens, heads, head_dim)
    scales = per_layer[:, :, rows * head_dim:].view(SCALE_DTYPE).view(n, layers, kv, tokens, heads)
    return values, scales


def check_codec(codec: str) -> CodecSpec:
    if codec not in SPECS:
        raise KernelInputError(f"codec {codec!r} is not a quantizing codec ({', '.join(CODECS)})")
    return SPECS[codec]


def check_encode(blocks: torch.Tensor, codec: str, out: torch.Tensor | None) -> CodecSpec:
    spec = check_codec(codec)
    if blocks.dtype not in SUPPORTED_DTYPES:
        raise KernelDTypeError(f"blocks dtype {blocks.dtype} not in {SUPPORTED_DTYPES}")
    if blocks.dim() != 6 or blocks.shape[2] != 2 or not blocks.is_contiguous():
        raise KernelShapeError("blocks must be a contiguous [n, num_layers, 2, block_tokens, "
                               f"num_kv_heads, head_dim] tensor, got shape {tuple(blocks.shape)}")
    if out is not None:
        _check_encoded("out", out, blocks.shape[0], tuple(blocks.shape[1:]), blocks.device)
    return spec


def check_decode(encoded: torch.Tensor, codec: str, kv_cache: torch.Tensor,
                 block_ids: torch.Tensor) -> CodecSpec:
    spec = check_codec(codec)
    if kv_cache.dtype not in SUPPORTED_DTYPES or kv_cache.dim() != 6 or not kv_cache.is_contiguous():
        raise KernelShapeError("kv_cache must be a contiguous [num_blocks, num_layers, 2, "
                               f"block_tokens, num_kv_heads, head_dim] tensor of {SUPPORTED_DTYPES}")
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise KernelShapeError("block_ids must be a 1-D int32/int64 tensor")
    _check_encoded("encoded", encoded, block_ids.shape[0], tuple(kv_cache.shape[1:]), kv_cache.device)
    return spec


def _check_encoded(name: str, t: torch.Tensor, n: int, block_shape: tuple, device) -> None:
    expect = (n, encoded_bytes(block_shape))
    if t.dtype != torch.uint8 or tuple(t.shape) != expect or not t.is_contiguous():
        raise KernelShapeError(f"{name} must be a contiguous uint8 tensor of shape {expect}, got "
                               f"{t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise KernelInputError(f"{name} is on {t.device}, the blocks on {device}")


def encode_blocks(blocks: torch.Tensor, codec: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize n contiguous blocks; returns uint8 [n, encoded_bytes] on their device."""
    spec = check_encode(blocks, codec, out)
    n, shape = blocks.shape[0], tuple(blocks.shape[1:])
    if out is None:
        out = torch.empty((n, encoded_bytes(shape)), dtype=torch.uint8, device=blocks.device)
    values, scales = encoded_views(out, shape)
    if n and blocks.device.type == "cpu":
        codec_cpu.encode(blocks, values, scales, codec, spec.qmax, SCALE_MIN, spec.scale_max)
    elif n:
        encode_torch(blocks, values, scales, codec, spec)
    return out


def encode_torch(blocks: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, codec: str,
                  spec: CodecSpec) -> None:
    """The definition of the codec, in torch ops on any device (the CPU path must match it)."""
    x = blocks.float()
    amax = x.abs().amax(-1)
    scale = (amax / spec.qmax).clamp_(SCALE_MIN, spec.scale_max).to(SCALE_DTYPE)
    # rounded to the nearest fp16, a scale may come out below amax / qmax, and the row's
    # largest values then clamp: in fp16's subnormals by up to a third of them (an int8
    # row of amax 1e-5 lost 24%). One fp16 up, it holds them: half a step at most, always.
    short = (scale.float() * spec.qmax < amax) & (scale < spec.scale_max)
    scale = (scale.view(torch.int16) + short.to(torch.int16)).view(SCALE_DTYPE)
    scales.copy_(scale)
    y = x / scale.float().unsqueeze(-1)  # against the fp16 scale the decoder will read
    if codec == "int8":
        values.copy_(y.round_().clamp_(-spec.qmax, spec.qmax))
    else:
        values.copy_(y.clamp_(-spec.qmax, spec.qmax).to(torch.float8_e4m3fn).view(torch.int8))


def decode_blocks(encoded: torch.Tensor, codec: str, kv_cache: torch.Tensor,
                  block_ids: torch.Tensor) -> None:
    """Dequantize block i of `encoded` into kv_cache[block_ids[i]] (in place)."""
    check_decode(encoded, codec, kv_cache, block_ids)
    n = block_ids.shape[0]
    if n == 0:
        return
    values, scales = encoded_views(encoded, tuple(kv_cache.shape[1:]))
    ids = block_ids.tolist()
    start = 0
    for i in range(1, n + 1):  # runs of consecutive ids decode in place: no staging copy
        if i == n or ids[i] != ids[i - 1] + 1:
            dst = kv_cache[ids[start]:ids[start] + i - start]
            if dst.device.type == "cpu":
                codec_cpu.decode(values[start:i], scales[start:i], codec, dst, FP8_DECODE_BIAS)
            else:
                decode_torch(values[start:i], scales[start:i], codec, dst)
            start = i


def decode_torch(values: torch.Tensor, scales: torch.Tensor, codec: str, dst: torch.Tensor) -> None:
    """values/scales of m blocks -> dst [m, L, 2, bt, Hkv, D] (contiguous), in torch ops
    (any device; the CPU path, kernels.codec_cpu, must match it)."""
    out = dst if dst.dtype == torch.float32 else torch.empty(dst.shape, dtype=torch.float32,
                                                              device=dst.device)
    scale = scales.float().unsqueeze(-1)
    if codec == "int8":
        out.copy_(values)
    else:
        _fp8_bits_to_f32(values, out)
        scale = scale * FP8_DECODE_BIAS
    out.mul_(scale)
    if dst.dtype == torch.float16:  # saturate: 127 x a scale rounded up to fp16 can pass
        out.clamp_(-65504.0, 65504.0)  # its largest value, inf once stored
    if out is not dst:
        dst.copy_(out)


def _fp8_bits_to_f32(values: torch.Tensor, out: torch.Tensor) -> None:
    """e4m3fn bytes -> fp32 `out` holding value * 2^-120, exactly (no fp8 type needed: the
    CPU path does the same in numpy). Sign-extended to int32, shifted so the
    4 exponent and 3 mantissa bits land in fp32's low exponent / high mantissa bits (the
    exponent bias differs by 120; fp8 subnormals land on fp32 subnormals, same rule), and
    the copies of the sign bit above the exponent masked off. The encoder never emits NaN."""
    bits = out.view(torch.int32)
    bits.copy_(values)
    bits.bitwise_left_shift_(20)
    bits.bitwise_and_(-0x78100000)  # 0x87F00000: sign | exponent low 4 bits | mantissa top 3
