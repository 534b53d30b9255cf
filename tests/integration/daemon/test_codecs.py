"""Compressed namespaces through a real `kvtier serve`: the daemon stores each codec's
encoded blocks in slots of the encoded size, keeps them across a restart, never hands a
block of one codec to a client of another, and serves a corrupted compressed block as a
miss. The blocks are real encodings (engine_adapter.kvcodec) of bf16 KV-like values."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine_adapter.kvcodec import BlockCodec
from kvstore.client import Client
from kvstore.keys import Namespace, hash_blocks
from kvstore.layout import HEADER_BYTES
from kvstore.tiers.slabfile import stride_of

CODECS = ["raw", "int8", "fp8_e4m3", "zstd"]
HASH_AT = 44  # offset of the block hash in the 64-byte header (kvstore/layout.py)


def ns_of(codec: str) -> Namespace:
    return Namespace("codec-model", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                     codec=codec)


def encoded_blocks(codec: str, n: int, seed: int = 0) -> tuple[BlockCodec, torch.Tensor, torch.Tensor]:
    ns = ns_of(codec)
    g = torch.Generator().manual_seed(seed)
    model = (torch.randn((n, *ns.block_shape), generator=g) * 0.5).bfloat16()
    codec_ = BlockCodec(codec, ns.block_shape, torch.bfloat16)
    encoded, keep = codec_.encode(model)
    assert all(keep)
    return codec_, model, encoded.contiguous()


def decoded(codec: BlockCodec, encoded: torch.Tensor) -> torch.Tensor:
    out = torch.zeros((encoded.shape[0], *codec.block_shape), dtype=codec.dtype)
    if codec.is_raw:
        return encoded
    assert codec.decode(encoded, out, torch.arange(encoded.shape[0])) == encoded.shape[0]
    return out


def test_every_codecs_blocks_survive_a_restart_in_slots_of_their_size(make_daemon):
    d = make_daemon("--dram-size", "1MiB", "--ssd-size", "64MiB")
    stored = {}
    for codec in CODECS:
        ns = ns_of(codec)
        hashes = hash_blocks(ns, np.arange(20 * 16))
        codec_, model, encoded = encoded_blocks(codec, 20)
        with Client(d.url, namespace=ns) as c:  # the daemon takes blocks of the encoded size
            assert all(s.value == "stored" for s in c.put_n(hashes, encoded))
        stored[codec] = (hashes, codec_, model, encoded)
    assert ns_of("int8").block_bytes < ns_of("zstd").block_bytes < ns_of("raw").block_bytes
    assert d.stop() == 0
    d.start()  # same data dir: every namespace reopens from its SSD tier
    for codec, (hashes, codec_, model, encoded) in stored.items():
        back = torch.zeros_like(encoded)
        with Client(d.url, namespace=ns_of(codec)) as c:
            assert None not in c.get_n(hashes, back)
        assert torch.equal(back, encoded)
        got = decoded(codec_, back)
        if codec in ("raw", "zstd"):
            assert torch.equal(got, model)  # lossless
        else:
            assert (got.float() - model.float()).abs().max() < 0.2


def test_a_block_of_another_codec_is_a_miss_never_another_codecs_bytes(make_daemon):
    d = make_daemon()
    hashes = hash_blocks(ns_of("int8"), np.arange(4 * 16))
    _, _, encoded = encoded_blocks("int8", 4)
    with Client(d.url, namespace=ns_of("int8")) as c:
        c.put_n(hashes, encoded)
        assert c.match_prefix(hashes).num_blocks == 4
    for other in ("raw", "fp8_e4m3", "zstd"):
        ns = ns_of(other)
        with Client(d.url, namespace=ns) as c:  # the same hashes asked in another namespace
            assert c.match_prefix(hashes).num_blocks == 0
            assert c.get_n(hashes, np.zeros((4, ns.block_bytes), np.uint8)) == [None] * 4


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "zstd"])
def test_a_corrupted_compressed_block_on_ssd_is_a_miss(make_daemon, tmp_path, codec):
    data = str(tmp_path / "data")
    d = make_daemon("--dram-size", "0", "--ssd-size", "16MiB", data_dir=data)  # SSD only
    ns = ns_of(codec)
    hashes = hash_blocks(ns, np.arange(6 * 16))
    _, _, encoded = encoded_blocks(codec, 6)
    with Client(d.url, namespace=ns) as c:
        c.put_n(hashes, encoded)
    assert d.stop() == 0
    flip_payload_byte(os.path.join(data, f"{ns.ns_id:016x}", "ssd"), hashes[2],
                      ns.block_bytes, offset=ns.block_bytes // 2)
    d.start()
    back = torch.zeros_like(encoded)
    with Client(d.url, namespace=ns) as c:
        found = c.get_n(hashes, back)
    assert [t is None for t in found] == [False, False, True, False, False, False]
    assert torch.equal(back[[0, 1, 3, 4, 5]], encoded[[0, 1, 3, 4, 5]])


def flip_payload_byte(ssd_dir: str, block_hash: bytes, block_bytes: int, offset: int) -> None:
    """Flip a bit in a block's payload in an SSD tier directory (slot i's header at i * 64
    of headers.dat holds the block's hash, its payload at i * stride of slabs.dat), found by
    its hash, with the daemon stopped."""
    with open(os.path.join(ssd_dir, "headers.dat"), "rb") as f:
        headers = f.read()
    at = headers.find(bytes(block_hash)) - HASH_AT
    assert at >= 0 and at % HEADER_BYTES == 0 and headers[at:at + 4] == b"KVTB"
    with open(os.path.join(ssd_dir, "slabs.dat"), "r+b") as f:
        f.seek(at // HEADER_BYTES * stride_of(block_bytes) + offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
