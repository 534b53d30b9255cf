"""Block identity: namespaces and prefix-chained block hashes.

A block is `block_tokens` consecutive token ids. Its key is a 16-byte `BlockHash`:

    h_i = xxh3_128(h_{i-1} || tokens_i as little-endian int32 || extra)

seeded by `h_{-1} = Namespace.root_hash`, itself xxh3_128 over a canonical encoding of the
model fingerprint (name, revision, dtype, KV layout, block_tokens) and the tenant salt. Every
input is fixed-width or length-prefixed, so the recipe is deterministic across processes,
restarts and machines; Python's `hash()` is never involved. Only full blocks are hashed.
Tensor-parallel sharding is not in the chain: it goes next to the hash in the object key.
"""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Iterable, NewType, Sequence

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)
"""16 bytes; the key of one block of one namespace."""

HASH_BYTES = 16
KV_LAYOUT = "LKTHD"  # [num_layers, 2 (K,V), block_tokens, num_kv_heads, head_dim]
_RECIPE = b"kvtier/block-hash/v1"
MAX_DIM = 1 << 16          # each of layers, kv heads, head_dim, block_tokens
MAX_NAME_BYTES = 1024      # model, revision, dtype and tenant strings
MAX_BLOCK_BYTES = 1 << 30  # one block of one shard

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

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "revision", "tenant"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value.encode()) > MAX_NAME_BYTES:
                raise ValueError(f"Namespace.{name} must be a string of at most "
                                 f"{MAX_NAME_BYTES} bytes")
        if not self.model:
            raise ValueError("Namespace.model must name the model (e.g. 'HuggingFaceTB/SmolLM2-135M')")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"Namespace.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if type(value) is not int or not 0 < value <= MAX_DIM:
                raise ValueError(f"Namespace.{name} must be an int in [1, {MAX_DIM}], "
                                 f"got {value!r}")
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise ValueError(f"a block of this namespace would be {self.block_bytes} bytes; "
                             f"blocks are at most {MAX_BLOCK_BYTES} bytes (use fewer "
                             "block_tokens)")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * DTYPE_BYTES[self.dtype]

    @property
    def root_hash(self) -> BlockHash:
        return _root_hash(self.model, self.revision, self.dtype, self.num_layers,
                          self.num_kv_heads, self.head_dim, self.block_tokens, self.tenant)

    @property
    def ns_id(self) -> int:
        """A 64-bit id of the namespace, carried in block headers and storage keys."""
        return int.from_bytes(self.root_hash[:8], "little")


@functools.lru_cache(maxsize=4096)  # read on every block header check: computed once
def _root_hash(model: str, revision: str, dtype: str, num_layers: int, num_kv_heads: int,
               head_dim: int, block_tokens: int, tenant: str) -> BlockHash:
    fingerprint = b"".join(
        [_RECIPE, _field(model), _field(revision), _field(dtype), _field(KV_LAYOUT),
         struct.pack("<4I", num_layers, num_kv_heads, head_dim, block_tokens), _field(tenant)])
    return BlockHash(xxhash.xxh3_128_digest(fingerprint))


def _as_int32_bytes(token_ids: Sequence[int] | np.ndarray) -> memoryview:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
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
