import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvstore.keys import Namespace, hash_blocks

VECTORS = pathlib.Path(__file__).parents[2] / "data" / "block_hash_vectors.json"
NS = Namespace("tiny", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", block_tokens=4)


def test_committed_vectors_match():
    doc = json.loads(VECTORS.read_text())
    assert len(doc["cases"]) >= 10
    for case in doc["cases"]:
        ns = Namespace(**case["namespace"])
        assert ns.root_hash.hex() == case["root"]
        assert ns.ns_id == case["ns_id"]
        got = hash_blocks(ns, case["tokens"], extra=bytes.fromhex(case["extra"]))
        assert [h.hex() for h in got] == case["hashes"]


def test_same_hashes_in_a_process_with_another_hash_seed():
    tokens = list(range(100))
    here = [h.hex() for h in hash_blocks(NS, tokens, extra=b"x")]
    code = ("import json; from kvstore.keys import Namespace, hash_blocks; "
            "ns = Namespace('tiny', num_layers=2, num_kv_heads=1, head_dim=4, dtype='float32', "
            "block_tokens=4); print(json.dumps([h.hex() for h in hash_blocks(ns, list(range(100)), "
            "extra=b'x')]))")
    for seed in ("1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert json.loads(out.stdout) == here


def test_only_full_blocks_are_hashed():
    assert len(hash_blocks(NS, list(range(11)))) == 2
    assert hash_blocks(NS, list(range(3))) == []


def test_chain_is_prefix_consistent_and_resumable():
    whole = hash_blocks(NS, list(range(32)))
    assert hash_blocks(NS, list(range(16))) == whole[:4]
    assert hash_blocks(NS, list(range(16, 32)), parent=whole[3]) == whole[4:]
    assert all(len(h) == 16 for h in whole) and len(set(whole)) == len(whole)


def test_a_different_token_changes_that_block_and_every_later_one():
    a = hash_blocks(NS, list(range(16)))
    changed = list(range(16))
    changed[5] = 999
    b = hash_blocks(NS, changed)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:]))


@pytest.mark.parametrize("field,value", [
    ("tenant", "other"), ("model", "other"), ("revision", "v2"), ("dtype", "float16"),
    ("block_tokens", 8), ("num_layers", 3), ("num_kv_heads", 2), ("head_dim", 8)])
def test_every_namespace_field_separates_hashes(field, value):
    other = Namespace(**{**NS.__dict__, field: value})
    assert other.root_hash != NS.root_hash
    assert hash_blocks(other, list(range(16)))[0] != hash_blocks(NS, list(range(16)))[0]


def test_extra_keys_separate_hashes():
    assert hash_blocks(NS, list(range(8)), extra=b"lora1") != hash_blocks(NS, list(range(8)))


def test_numpy_and_list_inputs_agree():
    toks = [5, 6, 7, 8, 9, 10, 11, 12]
    assert hash_blocks(NS, np.array(toks, dtype=np.int64)) == hash_blocks(NS, toks)


@pytest.mark.parametrize("kw", [dict(model=""), dict(dtype="float64"), dict(block_tokens=0),
                                dict(num_layers=-1)])
def test_bad_namespace_is_refused(kw):
    with pytest.raises(ValueError):
        Namespace(**{**NS.__dict__, **kw})


def test_bad_tokens_and_parent_are_refused():
    with pytest.raises(ValueError, match="int32"):
        hash_blocks(NS, [2**40, 1, 2, 3])
    with pytest.raises(ValueError, match="1-D"):
        hash_blocks(NS, np.zeros((2, 4)))
    with pytest.raises(ValueError, match="16 bytes"):
        hash_blocks(NS, list(range(4)), parent=b"short")


@pytest.mark.parametrize("tokens", [[1.5, 2.7, 3.0, 4.0], [float("nan"), 1, 2, 3],
                                    [float("inf")] * 4, [True, False, True, False],
                                    ["a", "b", "c", "d"]])
def test_token_ids_that_are_not_integers_are_refused(tokens):
    """1.5 would hash as 1 and NaN as whatever int32 it casts to: another prompt's KV."""
    with pytest.raises(ValueError, match="integers"):
        hash_blocks(NS, tokens)


def test_integral_floats_hash_as_their_integers():
    toks = np.arange(2 * NS.block_tokens)
    assert hash_blocks(NS, toks.astype(np.float64)) == hash_blocks(NS, toks)


def test_block_shape_and_bytes():
    ns = Namespace("m", num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16")
    assert ns.block_shape == (30, 2, 16, 3, 64)
    assert ns.block_bytes == 30 * 2 * 16 * 3 * 64 * 2


def test_raw_is_the_default_codec_and_leaves_the_hash_as_it_was():
    assert NS.codec == "raw"
    assert Namespace(**{**NS.__dict__, "codec": "raw"}).root_hash == NS.root_hash


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "zstd"])
def test_a_codec_separates_hashes_from_raw_and_from_each_other(codec):
    other = Namespace(**{**NS.__dict__, "codec": codec})
    roots = {Namespace(**{**NS.__dict__, "codec": c}).root_hash for c in ("raw", "int8", "fp8_e4m3", "zstd")}
    assert len(roots) == 4
    assert hash_blocks(other, list(range(16)))[0] != hash_blocks(NS, list(range(16)))[0]


def test_committed_vectors_cover_every_codec():
    doc = json.loads(VECTORS.read_text())
    assert {c["namespace"].get("codec", "raw") for c in doc["cases"]} == {"raw", "int8", "fp8_e4m3", "zstd"}


def test_unknown_codec_is_refused_by_name():
    with pytest.raises(ValueError, match="codec 'int4' is not one of raw, int8, fp8_e4m3, zstd"):
        Namespace(**{**NS.__dict__, "codec": "int4"})


def test_encoded_block_bytes_per_codec():
    ns = dict(model="m", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    raw = Namespace(**ns).block_bytes
    assert raw == 30 * 2 * 16 * 3 * 64 * 4
    for codec in ("int8", "fp8_e4m3"):  # 1-byte values + an fp16 scale per token and head
        enc = Namespace(**ns, codec=codec)
        assert enc.block_bytes == 30 * 2 * 16 * 3 * (64 + 2) and enc.raw_block_bytes == raw
        assert enc.block_bytes / raw <= 0.26
    assert Namespace(**ns, codec="zstd").block_bytes == 8 + raw * 15 // 16


def test_a_zstd_namespace_too_small_for_any_frame_is_refused():
    """Room for fewer bytes than zstd's smallest frame: every put would be NO_SPACE (the
    namespace was taken and failed every block). The bound is zstd's own: a block of zeros
    just that big fits its slot."""
    import zstandard
    tiny = dict(model="m", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", block_tokens=1)
    with pytest.raises(ValueError, match="room for 15 bytes of frame.*smallest is 17"):
        Namespace(**tiny, codec="zstd")
    fits = Namespace(**{**tiny, "head_dim": 5}, codec="zstd")
    room = fits.block_bytes - 8
    assert room >= 17 and len(zstandard.ZstdCompressor().compress(bytes(fits.raw_block_bytes))) <= room
