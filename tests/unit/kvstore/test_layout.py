import numpy as np
import pytest
import torch

from kvstore.errors import BlockFormatError, BlockSizeError, ChecksumError, NamespaceMismatchError
from kvstore.keys import Namespace, hash_blocks
from kvstore.layout import HEADER_BYTES, decode_block, decode_header, encode_block, payload_tensor

NS = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
H = hash_blocks(NS, list(range(4)))[0]


def _payload(seed=0):
    return torch.randn(NS.block_shape, generator=torch.Generator().manual_seed(seed)).half()


def test_roundtrip_gives_a_view_of_the_same_bytes():
    t = _payload()
    blob = bytearray(encode_block(NS, H, t))
    assert len(blob) == HEADER_BYTES + NS.block_bytes
    header, payload = decode_block(NS, blob, expect_hash=H)
    assert header.block_hash == H and header.shape == NS.block_shape and header.dtype == "float16"
    back = payload_tensor(NS, payload)
    assert torch.equal(back, t)
    blob[HEADER_BYTES] ^= 0xFF  # the view shares the caller's buffer: no copy was made
    assert payload[0] == blob[HEADER_BYTES]


def test_flipped_payload_byte_is_a_checksum_error():
    blob = bytearray(encode_block(NS, H, _payload()))
    blob[-7] ^= 0x01
    with pytest.raises(ChecksumError, match="corrupted"):
        decode_block(NS, blob)


def test_other_namespace_is_refused():
    other = Namespace(**{**NS.__dict__, "tenant": "t2"})
    with pytest.raises(NamespaceMismatchError):
        decode_block(other, encode_block(NS, H, _payload()))


@pytest.mark.parametrize("mutate,match", [
    (lambda b: b[:10], "shorter"),
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b[:4] + b"\x09\x00" + b[6:], "version"),
    (lambda b: b[:-1], "bytes"),
])
def test_malformed_blocks_are_refused(mutate, match):
    with pytest.raises(BlockFormatError, match=match):
        decode_block(NS, mutate(encode_block(NS, H, _payload())))


def test_wrong_hash_and_wrong_size():
    with pytest.raises(BlockFormatError, match="expected"):
        decode_block(NS, encode_block(NS, H, _payload()), expect_hash=b"\0" * 16)
    with pytest.raises(BlockSizeError, match="bytes"):
        encode_block(NS, H, np.zeros(10, dtype=np.uint8))


def test_header_decodes_alone():
    header = decode_header(encode_block(NS, H, _payload())[:HEADER_BYTES])
    assert header.ns_id == NS.ns_id


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "zstd"])
def test_a_compressed_block_records_its_codec_and_another_codec_is_refused(codec):
    ns = Namespace(**{**NS.__dict__, "codec": codec})
    h = hash_blocks(ns, list(range(4)))[0]
    blob = encode_block(ns, h, np.arange(ns.block_bytes, dtype=np.uint64).astype(np.uint8))
    header, payload = decode_block(ns, blob, expect_hash=h)
    assert header.codec == codec and len(payload) == ns.block_bytes
    assert decode_header(blob[:HEADER_BYTES]).codec == codec
    for other in ("raw", "int8", "fp8_e4m3", "zstd"):
        if other != codec:
            with pytest.raises(NamespaceMismatchError, match=f"codec {codec}"):
                decode_block(Namespace(**{**NS.__dict__, "codec": other}), blob)


def test_a_compressed_payload_is_not_viewed_as_model_values():
    ns = Namespace(**{**NS.__dict__, "codec": "int8"})
    with pytest.raises(BlockSizeError, match="decode it"):
        payload_tensor(ns, bytes(ns.block_bytes))
