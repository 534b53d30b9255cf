"""Compressed namespaces through the connector and a real TieredStore: every codec saves
fewer bytes and loads a prefix that the model then runs on; zstd is exact; wrong-codec
blocks are misses; a corrupt compressed block ends the prefix; blocks survive a reopen."""
import pytest
import torch

from engine_adapter.config import EngineConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.kvcodec import BlockCodec
from engine_adapter.loader import random_model
from engine_adapter.sampling import SamplingParams
from kvstore.config import StoreConfig, TierConfig
from kvstore.store import TieredStore
from kvstore.testing import flip_ssd_byte

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# zstd runs on a bf16 cache: fp32 KV of this tiny random model (2 KiB blocks) compresses to
# ~0.95, over zstd's 15/16 slot, so none of its blocks would be stored (see the last tests)
CODECS = [("int8", "float32"), ("fp8_e4m3", "float32"), ("zstd", "bfloat16")]


@pytest.fixture(scope="module")
def models(tiny_model):
    return {"float32": tiny_model, "bfloat16": random_model(tiny_model.config, seed=0, dtype="bfloat16")}


def config(codec, dtype="float32"):
    return EngineConfig(num_blocks=64, block_tokens=4, max_num_batched_tokens=64, kv_codec=codec,
                        dtype=dtype)


def open_store(ns, path=None):
    tiers = [TierConfig("dram", 64)] + ([TierConfig("ssd", 256, path=str(path))] if path else [])
    return TieredStore(ns, StoreConfig(tiers=tuple(tiers)))


def run(model, prompt, store=None, cfg=None):
    engine = LLMEngine(model, cfg or config("raw"), store=store, record_logits=True)
    out = engine.generate([prompt], GREEDY)[0]
    engine.close()
    return out, engine.logits[out.request_id], engine


def max_logit_gap(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("codec,dtype", CODECS)
def test_a_compressed_prefix_loads_and_the_output_stays_close(models, prompts, codec, dtype):
    model = models[dtype]
    base, base_logits, _ = run(model, prompts[2], cfg=config("raw", dtype))
    ns = LLMEngine(model, config(codec, dtype)).ns
    assert ns.codec == codec and ns.block_bytes < ns.raw_block_bytes
    with open_store(ns) as store:
        run(model, prompts[2], store, config(codec, dtype))
        out, logits, engine = run(model, prompts[2], store, config(codec, dtype))
        assert store.stats().tiers[0].used_blocks >= 10  # every prompt block was stored
    assert out.num_loaded_tokens == 36 and engine.connector.stats.load_misses == 0
    if codec == "zstd":  # lossless
        assert max_logit_gap(logits, base_logits) < 1e-4 and out.token_ids == base.token_ids
    else:  # quantized: not the same KV, but close to it (first token only: on this random
        # model one flipped near-tie changes every later step)
        assert 0 < (logits[0] - base_logits[0]).abs().max() < 0.3


@pytest.mark.parametrize("codec,dtype", CODECS)
def test_compressed_blocks_survive_a_reopen_and_a_corrupt_one_ends_the_prefix(
        models, prompts, codec, dtype, tmp_path):
    model, cfg = models[dtype], config(codec, dtype)
    engine = LLMEngine(model, cfg)
    hashes = engine.add_request(prompts[2], GREEDY).block_hashes
    with open_store(engine.ns, tmp_path) as store:
        run(model, prompts[2], store, cfg)
    with open_store(engine.ns, tmp_path) as store:  # a restart: from the SSD tier
        assert store.match_prefix(hashes).num_blocks == 10
        first, _, _ = run(model, prompts[2], store, cfg)
    with open_store(engine.ns, tmp_path) as store:
        flip_ssd_byte(store, hashes[3])
        out, _, loader = run(model, prompts[2], store, cfg)
        assert sum(t.counters.corrupt for t in store.stats().tiers) == 1  # ended the prefix
    assert first.num_loaded_tokens == 36
    assert out.num_loaded_tokens == 12 and loader.connector.stats.loaded_blocks == 3


def test_raw_blocks_are_a_miss_for_a_compressed_engine_and_back(tiny_model, prompts):
    raw_ns = LLMEngine(tiny_model, config("raw")).ns
    with open_store(raw_ns) as store:
        run(tiny_model, prompts[2], store)  # raw blocks stored
        int8 = LLMEngine(tiny_model, config("int8"))
        hashes = int8.add_request(prompts[2], GREEDY).block_hashes
        assert store.match_prefix(hashes).num_blocks == 0  # another root: other hashes
    with pytest.raises(ValueError, match="kv_codec='raw'"):
        LLMEngine(tiny_model, config("int8"), store=open_store(raw_ns))


def test_a_zstd_block_too_big_for_its_slot_is_not_stored_and_counted(tiny_model, prompts):
    codec = BlockCodec("zstd", (2, 2, 4, 2, 16), torch.float32)
    noise = torch.randn((2, *codec.block_shape))   # fp32 noise: mantissas do not compress
    noise[1] = 0.0
    _, keep = codec.encode(noise)
    assert keep == [False, True]
    cfg = config("zstd")
    with open_store(LLMEngine(tiny_model, cfg).ns) as store:
        out, _, engine = run(tiny_model, prompts[2], store, cfg)
    assert engine.connector.stats.save_unencodable_blocks >= 10  # fp32 KV: ~0.95 of raw
    assert engine.connector.stats.saved_blocks == 0 and out.num_loaded_tokens == 0


def test_bf16_cache_with_int8(models, prompts):
    bf16 = models["bfloat16"]
    base, base_logits, _ = run(bf16, prompts[1], cfg=config("raw", "bfloat16"))
    ns = LLMEngine(bf16, config("int8", "bfloat16")).ns
    with open_store(ns) as store:
        run(bf16, prompts[1], store, config("int8", "bfloat16"))
        out, logits, _ = run(bf16, prompts[1], store, config("int8", "bfloat16"))
    assert out.num_loaded_tokens == 16 and (logits[0] - base_logits[0]).abs().max() < 0.3


def test_unknown_codec_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_codec must be one of raw, int8, fp8_e4m3, zstd"):
        EngineConfig(kv_codec="int4")


def test_a_zstd_block_whose_length_cannot_be_is_a_miss_not_a_failed_request(models, prompts):
    """A DRAM slot carries no checksum: bytes no encoder wrote (all 0xFF: a frame length
    past the slot) in a prompt's first block made decode view zero blocks and raise, and
    the request failed instead of recomputing."""
    model, cfg = models["bfloat16"], config("zstd", "bfloat16")
    prompt = prompts[2]
    expect = run(model, prompt, cfg=cfg)[0].token_ids
    probe = LLMEngine(model, cfg)
    hashes = probe.add_request(prompt, GREEDY).block_hashes
    store = open_store(probe.ns)
    try:
        store.put_n(hashes[:1], torch.full((1, probe.ns.block_bytes), 0xFF, dtype=torch.uint8))
        engine = LLMEngine(model, cfg, store=store)
        out = engine.generate([prompt], GREEDY)[0]
        engine.close()
        assert out.token_ids == expect and out.num_loaded_tokens == 0
    finally:
        store.close()


def _zstd_slot(codec: BlockCodec, frame: bytes) -> torch.Tensor:
    """One zstd slot: u32 frame length, u32 0, the frame, zeros."""
    slot = torch.zeros((1, codec.block_bytes), dtype=torch.uint8)
    head = len(frame).to_bytes(4, "little") + bytes(4)
    slot[0, :8 + len(frame)] = torch.frombuffer(bytearray(head + frame), dtype=torch.uint8)
    return slot


def test_zstd_frames_that_are_not_one_block_of_ours_are_misses_before_decompressing():
    """A frame is decompressed only if it declares one block's size: a 16 KB frame of
    512 MiB of zeros (a decompression bomb in a 60 KB slot) took +2 GiB for four blocks;
    frames declaring 2^40 bytes or no size, or a slot of length 0, raised (a traceback per
    load). A frame of the right size with a bit flipped fails its content checksum: a miss,
    not other KV."""
    import zstandard
    shape, dtype = (2, 2, 4, 2, 16), torch.bfloat16
    codec = BlockCodec("zstd", shape, dtype)
    size = codec.raw_bytes
    cache = torch.zeros((4, *shape), dtype=dtype)
    block = torch.randn((1, *shape), generator=torch.Generator().manual_seed(0)).to(dtype)
    good, keep = codec.encode(block)
    assert keep == [True]
    assert codec.decode(good, cache, torch.tensor([1])) == 1 and torch.equal(cache[1], block[0])
    plain = zstandard.ZstdCompressor()
    bomb = plain.compress(bytes(1 << 24))  # (16 MiB here: what matters is what it declares)
    unsized = b"".join(plain.read_to_iter(__import__("io").BytesIO(bytes(size))))
    flipped = bytearray(good[0, 8:8 + int.from_bytes(bytes(good[0, :4].tolist()), "little")]
                        .numpy().tobytes())
    flipped[len(flipped) // 2] ^= 0x10
    for frame in (bomb, unsized, bytes(flipped), b""):
        cache.zero_()
        slot = _zstd_slot(codec, frame)
        assert codec.decode(torch.cat([slot, good]), cache, torch.tensor([1, 2])) == 0
        assert not cache.any()


@pytest.mark.parametrize("codec_name,bad", [
    (c, b) for c in ("int8", "fp8_e4m3") for b in ("nan", "inf", "zero", "out-of-range")]
    + [("fp8_e4m3", "fp8-nan-value")])
def test_quantized_blocks_with_values_no_encoder_writes_end_the_prefix(codec_name, bad):
    """A quantized block whose scales are NaN, inf, 0 or past the codec's largest (or, fp8,
    a NaN value) was decoded into the cache (no checksum in DRAM), and the model ran on NaN
    KV; now it ends the decoded prefix there, like a miss."""
    from kernels.codec import encoded_views
    shape = (2, 2, 4, 2, 16)
    codec = BlockCodec(codec_name, shape, torch.float32)
    blocks = torch.randn((3, *shape), generator=torch.Generator().manual_seed(1))
    encoded, _ = codec.encode(blocks)
    encoded = encoded.clone()
    values, scales = encoded_views(encoded, shape)
    if bad == "fp8-nan-value":
        values[1, 0, 1, 2, 1, 5] = 0x7F
    else:
        scales[1, 1, 0, 3, 1] = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0,
                                 "out-of-range": 60000.0 if codec_name == "fp8_e4m3" else -1.0}[bad]
    cache = torch.zeros((3, *shape))
    assert codec.decode(encoded, cache, torch.tensor([0, 1, 2])) == 1
    assert torch.isfinite(cache).all() and cache[0].any() and not cache[1:].any()
