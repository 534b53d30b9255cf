"""Block payload layout and the on-wire / on-disk block format.

Payload of a raw namespace: one block of one shard, contiguous `[num_layers, 2 (K,V),
block_tokens, num_kv_heads, head_dim]` in the model dtype, so a layer-wise loader can take a
slice. A compressed namespace (`Namespace.codec`, docs/compression.md) stores the engine's
encoding of that block, `Namespace.block_bytes` long (the engine encodes and decodes, in
kernels.codec; the store only moves and checksums the encoded bytes):

    int8, fp8_e4m3   per layer: values [2, bt, Hkv, D] (1 byte each) | scales [2, bt, Hkv]
                     (fp16: one per token and kv head; value = q * scale)
    zstd             frame length u32 | reserved u32 | zstd frame of the block's bytes
                     grouped by significance (byte i of every element, then byte i+1) |
                     zero padding up to the slot (15/16 of the raw bytes)

Encoded block = 64-byte header + payload. Header (little-endian):

    magic "KVTB" | version u16 | dtype code u8 | ndim u8 | ns_id u64 | shape 5 x u32 |
    checksum u64 (xxh3_64 of the payload) | block hash 16 bytes | codec u32 (0 = raw)

dtype and shape are the model's (what the block decodes to); the codec is in the namespace's
root hash too, so `ns_id` already tells codecs apart and the codec field is a second check.

Decoding verifies every field and the checksum; the payload comes back as a view into the
caller's buffer (no copy).
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvstore.errors import BlockFormatError, BlockSizeError, ChecksumError, NamespaceMismatchError
from kvstore.keys import CODECS, DTYPE_BYTES, HASH_BYTES, Namespace, encoded_block_bytes
from transfer.copy import loaded_torch

MAGIC = b"KVTB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHBBQ5IQ16sI")
_FIXED, _VARYING = struct.Struct("<4sHBBQ5I"), struct.Struct("<Q16sI")  # (its two halves)
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 64
CHECKSUM_AT = _FIXED.size  # where a header's payload checksum lies (kvstore/tiers/_slabio.c
assert CHECKSUM_AT == 36  # fills it in there: SUM_AT)

DTYPE_CODES = {
    "float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4, "float8_e5m2": 5,
    "int8": 6, "uint8": 7,
}
CODEC_CODES = {name: code for code, name in enumerate(CODECS)}  # raw = 0: the old reserved field


_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


class BlockHeader(NamedTuple):
    ns_id: int
    dtype: str
    shape: tuple[int, ...]
    checksum: int
    block_hash: bytes
    codec: str = "raw"


def checksum(payload) -> int:
    """xxh3_64 of a payload (any buffer: bytes, memoryview, contiguous CPU tensor)."""
    return xxhash.xxh3_64_intdigest(as_memoryview(payload))


def as_memoryview(buf) -> memoryview:
    """A flat byte view of a buffer or a contiguous CPU tensor, without copying."""
    torch = loaded_torch()  # (a tensor exists only where torch is loaded)
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise BlockSizeError("expected a contiguous CPU tensor")
        return memoryview(buf.view(torch.uint8).reshape(-1).numpy())
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def encode_header(ns: Namespace, block_hash: bytes, payload_checksum: int) -> bytes:
    return HeaderEncoder(ns)(block_hash, payload_checksum)


class HeaderEncoder:
    """`encode_header` for one namespace, its fixed fields packed once (a tier writes a
    header with every block: the namespace's id and shape cost ~3 us to look up each time)."""

    def __init__(self, ns: Namespace) -> None:
        self._fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[ns.dtype], 5, ns.ns_id,
                                  *ns.block_shape)
        self._codec = CODEC_CODES[ns.codec]

    def __call__(self, block_hash: bytes, payload_checksum: int) -> bytes:
        if len(block_hash) != HASH_BYTES:
            raise BlockFormatError(f"block hash must be {HASH_BYTES} bytes, got {len(block_hash)}")
        return self._fixed + _VARYING.pack(payload_checksum, block_hash, self._codec)

    def blanks(self, hashes) -> bytearray:
        """The headers of `hashes`, back to back, each checksum field zero (filled in where
        the payload is hashed: kvstore/tiers/_slabio.c's write_blocks)."""
        return bytearray(b"".join([self(bytes(h), 0) for h in hashes]))


def encode_block(ns: Namespace, block_hash: bytes, payload) -> bytes:
    """Header + payload as one bytes object (the SSD value; one copy of the payload)."""
    view = as_memoryview(payload)
    check_payload_size(ns, len(view))
    return b"".join((encode_header(ns, block_hash, checksum(view)), view))


def decode_header(buf) -> BlockHeader:
    view = as_memoryview(buf)
    if len(view) < HEADER_BYTES:
        raise BlockFormatError(f"encoded block is {len(view)} bytes, shorter than its "
                               f"{HEADER_BYTES}-byte header")
    magic, version, dcode, ndim, ns_id, *rest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BlockFormatError(f"bad magic {magic!r}: not a kvtier block")
    if version != FORMAT_VERSION:
        raise BlockFormatError(f"block format version {version} is not supported "
                               f"(this build reads version {FORMAT_VERSION})")
    if dcode not in _DTYPE_NAMES or ndim != 5:
        raise BlockFormatError(f"bad dtype code {dcode} or ndim {ndim} in block header")
    shape, (csum, bhash, ccode) = tuple(rest[:5]), rest[5:]
    if ccode >= len(CODECS):
        raise BlockFormatError(f"bad codec code {ccode} in block header")
    return BlockHeader(ns_id, _DTYPE_NAMES[dcode], shape, csum, bhash, CODECS[ccode])


def decode_block(ns: Namespace, buf, expect_hash: bytes | None = None) -> tuple[BlockHeader, memoryview]:
    """Validate an encoded block for `ns`; returns its header and a view of the payload.

    Raises NamespaceMismatchError for another namespace's block, BlockFormatError for a
    malformed one, ChecksumError when the payload does not match its checksum.
    """
    view = as_memoryview(buf)
    header = decode_header(view)
    if (header.ns_id != ns.ns_id or header.dtype != ns.dtype or header.shape != ns.block_shape
            or header.codec != ns.codec):
        raise NamespaceMismatchError(
            f"block belongs to namespace {header.ns_id:#x} ({header.dtype}, {header.shape}, "
            f"codec {header.codec}), not {ns.ns_id:#x} ({ns.dtype}, {ns.block_shape}, "
            f"codec {ns.codec})")
    payload = view[HEADER_BYTES:]
    if len(payload) != ns.block_bytes:
        raise BlockFormatError(f"encoded block carries {len(payload)} payload bytes, its header "
                               f"says {ns.block_bytes} (truncated or padded)")
    if expect_hash is not None and header.block_hash != expect_hash:
        raise BlockFormatError(f"block header names hash {header.block_hash.hex()}, "
                               f"expected {bytes(expect_hash).hex()}")
    if checksum(payload) != header.checksum:
        raise ChecksumError(f"checksum mismatch for block {header.block_hash.hex()}: "
                            "the stored bytes are corrupted")
    return header, payload


def verify_encoded(buf) -> BlockHeader:
    """Check an encoded block on its own (no namespace at hand): header, length, checksum."""
    view = as_memoryview(buf)
    header = decode_header(view)
    expected = encoded_block_bytes(header.codec, header.shape, DTYPE_BYTES[header.dtype])
    if len(view) - HEADER_BYTES != expected:
        raise BlockFormatError(f"encoded block carries {len(view) - HEADER_BYTES} payload bytes, "
                               f"its header says {expected} (truncated or padded)")
    if checksum(view[HEADER_BYTES:]) != header.checksum:
        raise ChecksumError(f"checksum mismatch for block {header.block_hash.hex()}")
    return header


def check_payload_size(ns: Namespace, nbytes: int) -> None:
    if nbytes != ns.block_bytes:
        raise BlockSizeError(f"block payload is {nbytes} bytes but namespace {ns.model!r} "
                             f"blocks are {ns.block_bytes} bytes ({ns.dtype} {ns.block_shape}, "
                             f"codec {ns.codec})")


def payload_tensor(ns: Namespace, payload):
    """View a raw payload buffer as a `[num_layers, 2, block_tokens, num_kv_heads, head_dim]`
    tensor (a compressed block is only bytes to the store: the engine decodes it)."""
    if ns.codec != "raw":
        raise BlockSizeError(f"a {ns.codec} block is not a tensor of the model's dtype; "
                             "decode it with kernels.decode_blocks")
    import torch  # (the caller wants a tensor)
    view = as_memoryview(payload)
    check_payload_size(ns, len(view))
    flat = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, ns.dtype)).view(ns.block_shape)
