"""Block identity: namespaces and prefix-chained block hashes.

A block is `block_tokens` consecutive token ids. Its key is a 16-byte `BlockHash`:

    h_i = xxh3_128(h_{i-1} || tokens_i as little-endian int32 || extra)

seeded by `h_{-1} = Namespace.root_hash`, itself xxh3_128 over a canonical encoding of the
model fingerprint (name, revision, dtype, KV layout, block_tokens), the tenant salt and, for a
compressed namespace only, the block codec (so raw hashes, and their committed vectors, are
unchanged, and raw and compressed blocks can never share a key). Every
input is fixed-width or length-prefixed, so the recipe is deterministic across processes,
restarts and machines; Python's `hash()` is never involved. Only full blocks are hashed.
Tensor-parallel sharding is not in the chain: it goes next to the hash in the object key.
"""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Annotated, Iterable, NewType, Sequence

import msgspec
import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)
"""16 bytes; the key of one block of one namespace."""

HASH_BYTES = 16
# A block hash as a field of a `transfer.codec.Record`: decoding refuses any other length.
HashField = Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]
KV_LAYOUT = "LKTHD"  # [num_layers, 2 (K,V), block_tokens, num_kv_heads, head_dim]
_RECIPE = b"kvtier/block-hash/v1"
MAX_DIM = 1 << 16          # each of layers, kv heads, head_dim, block_tokens
MAX_NAME_BYTES = 1024      # model, revision, dtype and tenant strings
MAX_BLOCK_BYTES = 1 << 30  # one block of one shard

# How blocks of a namespace are encoded at the store boundary (docs/compression.md). The
# engine side encodes and decodes (kernels.codec); the store only sees `block_bytes`.
CODECS = ("raw", "int8", "fp8_e4m3", "zstd")
QUANTIZABLE_DTYPES = ("float32", "float16", "bfloat16")
SCALE_BYTES = 2  # int8 / fp8_e4m3: one fp16 scale per (layer, K|V, token, kv head)
ZSTD_HEADER_BYTES = 8  # zstd: u32 frame length + u32 reserved, then the frame, zero padded
# A zstd slot holds at most 15/16 of the raw bytes: slots are fixed-size, so a bound is what
# makes a variable-size codec move fewer bytes; a block whose frame does not fit is not stored.
ZSTD_SLOT_NUM, ZSTD_SLOT_DEN = 15, 16
# zstd's smallest frame for a block of more than a few bytes (all one byte value: magic,
# frame header with the content size, one RLE block; 17 bytes for 8-64 zero bytes,
# zstandard 0.25): a slot with less room than this stores no block at all
ZSTD_MIN_FRAME_BYTES = 17

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1,
}


def _field(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True)
class Namespace:
    """One model's KV layout plus an optional tenant: blocks never cross namespaces."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_tokens: int = 16
    revision: str = "main"
    tenant: str = ""
    codec: str = "raw"

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "revision", "tenant", "codec"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value.encode()) > MAX_NAME_BYTES:
                raise ValueError(f"Namespace.{name} must be a string of at most "
                                 f"{MAX_NAME_BYTES} bytes")
        if not self.model:
            raise ValueError("Namespace.model must name the model (e.g. 'HuggingFaceTB/SmolLM2-135M')")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"Namespace.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.codec not in CODECS:
            raise ValueError(f"Namespace.codec {self.codec!r} is not one of {', '.join(CODECS)}")
        if self.codec in ("int8", "fp8_e4m3") and self.dtype not in QUANTIZABLE_DTYPES:
            raise ValueError(f"Namespace.codec {self.codec} quantizes {', '.join(QUANTIZABLE_DTYPES)} "
                             f"blocks, not {self.dtype} (use raw or zstd)")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if type(value) is not int or not 0 < value <= MAX_DIM:
                raise ValueError(f"Namespace.{name} must be an int in [1, {MAX_DIM}], "
                                 f"got {value!r}")
        if self.codec == "zstd" and self.block_bytes - ZSTD_HEADER_BYTES < ZSTD_MIN_FRAME_BYTES:
            raise ValueError(f"a zstd block of this namespace has room for "
                             f"{self.block_bytes - ZSTD_HEADER_BYTES} bytes of frame, and zstd's "
                             f"smallest is {ZSTD_MIN_FRAME_BYTES}: every block would be refused "
                             "(use codec raw, or more block_tokens)")
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise ValueError(f"a block of this namespace would be {self.block_bytes} bytes; "
                             f"blocks are at most {MAX_BLOCK_BYTES} bytes (use fewer "
                             "block_tokens)")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def raw_block_bytes(self) -> int:
        """One block as the model holds it: `block_shape` in `dtype`."""
        return math.prod(self.block_shape) * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """One stored block: the raw bytes, or the fixed encoded size of `codec`."""
        return _block_bytes(self.codec, self.num_layers, self.block_tokens, self.num_kv_heads,
                            self.head_dim, self.dtype)

    @property
    def root_hash(self) -> BlockHash:
        return _root_hash(self.model, self.revision, self.dtype, self.num_layers,
                          self.num_kv_heads, self.head_dim, self.block_tokens, self.tenant,
                          self.codec)

    @property
    def ns_id(self) -> int:
        """A 64-bit id of the namespace, carried in block headers and storage keys."""
        return int.from_bytes(self.root_hash[:8], "little")


def encoded_block_bytes(codec: str, block_shape: tuple[int, ...], dtype_bytes: int) -> int:
    """Bytes of one stored block of `codec` (layouts in kvstore/layout.py)."""
    layers, kv, tokens, heads, head_dim = block_shape
    raw = math.prod(block_shape) * dtype_bytes
    if codec == "raw":
        return raw
    if codec in ("int8", "fp8_e4m3"):
        return layers * kv * tokens * heads * (head_dim + SCALE_BYTES)
    if codec == "zstd":
        return ZSTD_HEADER_BYTES + -(-raw * ZSTD_SLOT_NUM // ZSTD_SLOT_DEN)
    raise ValueError(f"codec {codec!r} is not one of {', '.join(CODECS)}")


@functools.lru_cache(maxsize=4096)  # read on every block op: computed once per layout
def _block_bytes(codec: str, num_layers: int, block_tokens: int, num_kv_heads: int,
                 head_dim: int, dtype: str) -> int:
    shape = (num_layers, 2, block_tokens, num_kv_heads, head_dim)
    return encoded_block_bytes(codec, shape, DTYPE_BYTES[dtype])


@functools.lru_cache(maxsize=4096)  # read on every block header check: computed once
def _root_hash(model: str, revision: str, dtype: str, num_layers: int, num_kv_heads: int,
               head_dim: int, block_tokens: int, tenant: str, codec: str) -> BlockHash:
    fingerprint = b"".join(
        [_RECIPE, _field(model), _field(revision), _field(dtype), _field(KV_LAYOUT),
         struct.pack("<4I", num_layers, num_kv_heads, head_dim, block_tokens), _field(tenant)]
        + ([] if codec == "raw" else [_field("codec"), _field(codec)]))
    return BlockHash(xxhash.xxh3_128_digest(fingerprint))


def _as_int32_bytes(token_ids: Sequence[int] | np.ndarray) -> memoryview:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":  # 1.5 would hash as 1, NaN as anything
        if (arr.dtype.kind != "f" or not np.all(np.isfinite(arr))
                or np.any(arr != np.trunc(arr))):
            raise ValueError(f"token ids must be integers, got {arr.dtype} values such as "
                             f"{arr[0]!r}")
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    return memoryview(np.ascontiguousarray(arr, dtype="<i4")).cast("B")


def hash_blocks(
    ns: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    parent: bytes | None = None,
    extra: bytes = b"",
) -> list[BlockHash]:
    """Hashes of every *full* block of `token_ids`, chained from `parent` (default the root).

    `extra` (e.g. a LoRA id or multimodal content hash) is mixed into every block's hash.
    A trailing partial block is not hashed.
    """
    raw = _as_int32_bytes(token_ids)
    step = ns.block_tokens * 4
    prev = ns.root_hash if parent is None else parent
    if len(prev) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(prev)}")
    digest = xxhash.xxh3_128_digest
    out: list[BlockHash] = []
    for start in range(0, len(raw) - step + 1, step):
        prev = digest(b"".join((prev, raw[start:start + step], extra)))
        out.append(BlockHash(prev))
    return out


def num_full_blocks(ns: Namespace, num_tokens: int) -> int:
    return num_tokens // ns.block_tokens


def hex_hashes(hashes: Iterable[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def check_hashes(hashes: Sequence[bytes]) -> None:
    """Every block hash is HASH_BYTES long (a clear error for anything else)."""
    for h in hashes:
        if len(h) != HASH_BYTES:
            raise ValueError(f"block hashes are {HASH_BYTES} bytes; got one of {len(h)} bytes")


def hash_keys(hashes: Sequence[bytes]) -> list[bytes]:
    """The block hashes as `bytes` (the store's keys), each checked as `check_hashes` does."""
    check_hashes(hashes)
    return [h if type(h) is bytes else bytes(h) for h in hashes]
