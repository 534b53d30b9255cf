"""Triton int8 / fp8_e4m3 block codecs, bit-for-bit the reference's (`kernels.codec`).

One program codes ROWS rows of one layer of one block; a row is the head_dim values of one
(K|V, token, kv head), which share one fp16 scale. fp8 is coded with integer bit operations
rather than Triton's float8 casts: the same on every GPU and in the interpreter (whose cast
rounds wrongly where rounding carries into the exponent, e.g. 31.81 -> 16 instead of 32),
and decoded without fp32 subnormals (which a GPU may flush to zero).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import codec as ref
from kernels.triton.common import check_runnable, next_pow2

ROWS = 16  # rows per program


@triton.jit
def _rne(y):
    """Round half to even for |y| < 2^22 (the 1.5 * 2^23 trick)."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _fp8_e4m3_byte(y):
    """fp32 -> e4m3fn byte (0..255) with round half to even; |y| <= 448."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(y), 448.0)
    b = a.to(tl.int32, bitcast=True)
    r = b + 0x7FFFF + ((b >> 20) & 1)  # round the 20 dropped mantissa bits; carries go up
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    subnormal = _rne(a * 512.0).to(tl.int32)  # multiples of 2^-9 (8 codes 2^-6, the same bits)
    byte = tl.where(a < 0.015625, subnormal, normal)
    return tl.where(bits < 0, byte | 128, byte)


@triton.jit
def _fp8_e4m3_value(u):
    """e4m3fn byte (0..255, never NaN) -> fp32."""
    e = (u >> 3) & 15
    m = u & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where(u >= 128, -mag, mag)


@triton.jit
def _encode_kernel(x_ptr, q_ptr, s_ptr, R, LAYERS, BLOCK_BYTES, CHUNK,
                   QMAX: tl.constexpr, SMIN: tl.constexpr, SMAX: tl.constexpr, FP8: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr):
    bl = tl.program_id(0).to(tl.int64)  # block * LAYERS + layer
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D_PAD)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    x = tl.load(x_ptr + (bl * R + rows[:, None]) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.minimum(tl.maximum(tl.math.div_rn(amax, QMAX), SMIN), SMAX).to(tl.float16)
    short = (scale.to(tl.float32) * QMAX < amax) & (scale.to(tl.float32) < SMAX)
    scale = (scale.to(tl.int16, bitcast=True) + short.to(tl.int16)).to(tl.float16, bitcast=True)
    y = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
    if FP8:
        q = _fp8_e4m3_byte(y)
    else:
        q = _rne(tl.minimum(tl.maximum(y, -QMAX), QMAX)).to(tl.int32)
    base = (bl // LAYERS) * BLOCK_BYTES + (bl % LAYERS) * CHUNK  # this layer's bytes
    tl.store(q_ptr + base + rows[:, None] * D + cols[None, :], q.to(tl.int8), mask=mask)
    tl.store(s_ptr + (base + R * D) // 2 + rows, scale, mask=rows < R)


@triton.jit
def _decode_kernel(q_ptr, s_ptr, out_ptr, ids_ptr, R, LAYERS, BLOCK_BYTES, CHUNK,
                   FP8: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr,
                   VMAX: tl.constexpr):
    bl = tl.program_id(0).to(tl.int64)
    i, layer = bl // LAYERS, bl % LAYERS
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D_PAD)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    base = i * BLOCK_BYTES + layer * CHUNK
    q = tl.load(q_ptr + base + rows[:, None] * D + cols[None, :], mask=mask, other=0).to(tl.int32)
    scale = tl.load(s_ptr + (base + R * D) // 2 + rows, mask=rows < R, other=0.0).to(tl.float32)
    v = _fp8_e4m3_value(q & 255) if FP8 else q.to(tl.float32)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    dst = ((blk * LAYERS + layer) * R + rows[:, None]) * D + cols[None, :]
    val = tl.minimum(tl.maximum(v * scale[:, None], -VMAX), VMAX)  # fp16: 65504, not inf
    tl.store(out_ptr + dst, val.to(out_ptr.dtype.element_ty), mask=mask)


def _geometry(block_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(rows per layer, layers, head_dim, bytes of one layer's values + scales)."""
    layers, kv, tokens, heads, head_dim = block_shape
    rows = kv * tokens * heads
    return rows, layers, head_dim, rows * (head_dim + ref.SCALE_DTYPE.itemsize)


def encode_blocks(blocks: torch.Tensor, codec: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize n contiguous blocks; returns uint8 [n, encoded_bytes] on their device."""
    spec = ref.check_encode(blocks, codec, out)
    check_runnable(blocks)
    n, shape = blocks.shape[0], tuple(blocks.shape[1:])
    eb = ref.encoded_bytes(shape)
    if out is None:
        out = torch.empty((n, eb), dtype=torch.uint8, device=blocks.device)
    rows, layers, d, chunk = _geometry(shape)
    if n:
        _encode_kernel[(n * layers, triton.cdiv(rows, ROWS))](
            blocks, out.view(torch.int8), out.view(ref.SCALE_DTYPE), rows, layers, eb, chunk,
            QMAX=spec.qmax, SMIN=ref.SCALE_MIN, SMAX=spec.scale_max, FP8=codec == "fp8_e4m3",
            D=d, D_PAD=next_pow2(d), ROWS=ROWS)
    return out


def decode_blocks(encoded: torch.Tensor, codec: str, kv_cache: torch.Tensor,
                  block_ids: torch.Tensor) -> None:
    """Dequantize block i of `encoded` into kv_cache[block_ids[i]] (in place)."""
    ref.check_decode(encoded, codec, kv_cache, block_ids)
    check_runnable(kv_cache)
    n, shape = block_ids.shape[0], tuple(kv_cache.shape[1:])
    rows, layers, d, chunk = _geometry(shape)
    if n:
        _decode_kernel[(n * layers, triton.cdiv(rows, ROWS))](
            encoded.view(torch.int8), encoded.view(ref.SCALE_DTYPE), kv_cache, block_ids,
            rows, layers, ref.encoded_bytes(shape), chunk,
            FP8=codec == "fp8_e4m3", D=d, D_PAD=next_pow2(d), ROWS=ROWS,
            VMAX=65504.0 if kv_cache.dtype == torch.float16 else 3.0e38)
