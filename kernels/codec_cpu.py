"""The CPU path of the int8 / fp8_e4m3 block codecs: numpy on the calling thread, in
cache-sized chunks, bit-for-bit the torch reference (`kernels.codec`, which dispatches CPU
tensors here; the tests hold the two together).

Why not torch ops on the CPU: its intra-op thread pool spins on a busy host (measured on
this 2-core machine at load 4, 64 real SmolLM2 blocks: int8 decode 2.1 GB/s with 2 threads
vs 8.8 with one, encode 0.37 vs 0.86), and each fresh multi-MiB temporary is paid in page
faults. numpy's elementwise loops run on the caller's thread, and chunks of ~1 MiB keep
every temporary in cache. fp8 is coded with integer bit operations (numpy has no fp8):
the rounding is the one `kernels/triton/codec.py` documents.
"""
from __future__ import annotations

import numpy as np
import torch

FP16_MAX = np.float32(65504.0)  # the largest finite float16
ROWS_PER_CHUNK = 4096  # rows of head_dim values per numpy pass (~1 MiB of fp32 at D = 64)
FP8_MAX, FP8_MIN_NORMAL = 448.0, 2.0 ** -6


def rows_view(t: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """A [n * L, rows, head_dim] (or [n * L, rows] for scales) numpy view of a CPU tensor
    [n, L, 2, bt, Hkv(, D)] whose (n, L) and (2, bt, Hkv) dims can merge without a copy."""
    arr = (t if dtype is None else t.view(dtype)).numpy()
    view = arr.view()
    tail = arr.shape[5:]
    view.shape = (arr.shape[0] * arr.shape[1], int(np.prod(arr.shape[2:5])), *tail)  # raises if it would copy
    return view


def _as_f32(chunk: np.ndarray, model_dtype: torch.dtype) -> np.ndarray:
    if model_dtype == torch.bfloat16:  # int16 bits -> the fp32 with the same top 16 bits
        return (chunk.astype(np.int32) << 16).view(np.float32)
    return chunk.astype(np.float32, copy=False)


def _store(dst: np.ndarray, f32: np.ndarray, model_dtype: torch.dtype) -> None:
    if model_dtype == torch.bfloat16:  # round half to even into the top 16 bits
        bits = f32.view(np.int32)
        dst[...] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.int16)
    else:  # float16: saturate (127 x an fp16 scale rounded up can pass 65504: inf otherwise)
        np.clip(f32, -FP16_MAX, FP16_MAX, out=f32)
        dst[...] = f32


def _model_rows(t: torch.Tensor) -> np.ndarray:
    return rows_view(t, torch.int16 if t.dtype == torch.bfloat16 else None)


def encode(blocks: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, codec: str,
           qmax: float, scale_min: float, scale_max: float) -> None:
    """Quantize CPU `blocks` [n, L, 2, bt, Hkv, D] into the `values` / `scales` views."""
    x_rows, q_rows, s_rows = _model_rows(blocks), rows_view(values), rows_view(scales)
    step = max(1, ROWS_PER_CHUNK // x_rows.shape[1])
    for lo in range(0, x_rows.shape[0], step):
        x = _as_f32(x_rows[lo:lo + step], blocks.dtype)
        amax = np.abs(x).max(axis=-1)
        scale = np.clip(amax / np.float32(qmax), scale_min, scale_max).astype(np.float16)
        short = (scale.astype(np.float32) * np.float32(qmax) < amax) & (scale < scale_max)
        scale = (scale.view(np.int16) + short.astype(np.int16)).view(np.float16)  # (see
        s_rows[lo:lo + step] = scale  # kernels.codec.encode_torch: one fp16 up if short)
        y = x / scale.astype(np.float32)[..., None]
        if codec == "int8":
            q_rows[lo:lo + step] = np.clip(np.rint(y, out=y), -qmax, qmax, out=y)
        else:
            q_rows[lo:lo + step] = fp8_e4m3_bytes(y).view(np.int8)


def fp8_e4m3_bytes(y: np.ndarray) -> np.ndarray:
    """fp32 -> e4m3fn bytes, round half to even, saturating at +-448."""
    a = np.minimum(np.abs(y), np.float32(FP8_MAX))
    b = a.view(np.int32)
    r = b + 0x7FFFF + ((b >> 20) & 1)  # round the 20 dropped mantissa bits; carries go up
    byte = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    small = a < FP8_MIN_NORMAL  # subnormals: multiples of 2^-9 (code 8 is 2^-6, same bits)
    byte[small] = np.rint(a[small] * np.float32(512.0)).astype(np.int32)
    byte |= (y.view(np.int32) < 0).astype(np.int32) << 7
    return byte.astype(np.uint8)


def decode(values: torch.Tensor, scales: torch.Tensor, codec: str, dst: torch.Tensor,
           fp8_bias: float) -> None:
    """Dequantize the `values` / `scales` views of m blocks into contiguous CPU `dst`
    [m, L, 2, bt, Hkv, D]."""
    q_rows, s_rows, d_rows = rows_view(values), rows_view(scales), _model_rows(dst)
    direct = dst.dtype == torch.float32
    step = max(1, ROWS_PER_CHUNK // q_rows.shape[1])
    for lo in range(0, q_rows.shape[0], step):
        out = d_rows[lo:lo + step] if direct else np.empty(q_rows[lo:lo + step].shape, np.float32)
        scale = s_rows[lo:lo + step].astype(np.float32)[..., None]
        if codec == "int8":
            out[...] = q_rows[lo:lo + step]
        else:  # e4m3 bits into fp32's exponent / mantissa fields: the value times 2^-120
            bits = out.view(np.int32)
            bits[...] = q_rows[lo:lo + step]
            bits <<= 20
            bits &= -0x78100000  # 0x87F00000: sign, exponent low 4 bits, mantissa top 3
            scale = scale * np.float32(fp8_bias)
        out *= scale
        if not direct:
            _store(d_rows[lo:lo + step], out, dst.dtype)
