"""transformers prefix offload on SmolLM2-135M: a second generate sharing a long prefix loads
it from kvtier, computes only the rest, and yields exactly the tokens of a plain generate; in
the same process, and across two processes through one `kvtier serve`."""
import os

import pytest
import torch

pytest.importorskip("transformers")

from engine_adapter.plugins.base import StoreSpec
from engine_adapter.plugins.hf import (KVTierGenerate, blocks_to_cache, cache_to_blocks, enable_kvtier,
                                       namespace_for)
from kvstore.config import StoreConfig, TierConfig
from kvstore.events import TierKind
from kvstore.keys import hash_blocks
from kvstore.store import TieredStore
from kvstore.testing import flip_ssd_byte

DOC = ("The harbour town of Vell sits where two rivers meet. Its fishermen leave before dawn, "
       "its bakers light their ovens at four, and its lighthouse keeper, Ada Morn, has kept "
       "the lamp burning for thirty-one years without missing a night. ") * 6
QUESTIONS = ["Question: who keeps the lighthouse? Answer:",
             "Question: where do the two rivers meet? Answer:"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2():
    from engine_adapter.loader import load_hf_gguf
    model, tokenizer = load_hf_gguf()
    return model.eval(), tokenizer


def prompt_ids(tokenizer, question: str) -> torch.Tensor:
    return tokenizer(DOC + question, return_tensors="pt").input_ids


class ForwardTokens:
    """Counts the tokens of the first forward pass of each generate (the prefill)."""

    def __init__(self, model):
        self.seen: list[int] = []
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.seen.append(int(ids.shape[-1]))


def plain(model, ids):
    return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)


def test_second_call_loads_the_shared_prefix_and_matches_plain_generate(smollm2, tmp_path):
    model, tokenizer = smollm2
    first, second = (prompt_ids(tokenizer, q) for q in QUESTIONS)
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)))
    try:
        kv.generate(first, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert kv.last.num_loaded_tokens == 0 and kv.last.num_saved_blocks > 0
        counter = ForwardTokens(model)
        try:
            out = kv.generate(second, max_new_tokens=NEW_TOKENS, do_sample=False)
        finally:
            counter.handle.remove()
        shared = next(i for i, (a, b) in enumerate(zip(first[0], second[0])) if a != b)
        assert shared > 200
        assert kv.last.num_loaded_tokens == shared // 16 * 16
        assert kv.last.num_computed_tokens == second.shape[-1] - kv.last.num_loaded_tokens
        assert counter.seen[0] == kv.last.num_computed_tokens   # the model really skipped it
        assert torch.equal(out, plain(model, second))
    finally:
        kv.close()


def test_a_corrupted_block_ends_the_loaded_prefix_and_output_is_unchanged(smollm2, tmp_path):
    model, tokenizer = smollm2
    first, second = (prompt_ids(tokenizer, q) for q in QUESTIONS)
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)))
    kv.store.close()
    store = TieredStore(kv.ns, StoreConfig((TierConfig("ssd", 4096, path=str(tmp_path / "ssd")),)))
    kv.store = store  # SSD only, so the block can be corrupted on disk
    try:
        kv.generate(first, max_new_tokens=NEW_TOKENS, do_sample=False)
        bad = 3
        key = bytes(hash_blocks(kv.ns, first[0].tolist())[bad])
        flip_ssd_byte(store, key, offset=100)
        out = kv.generate(second, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert kv.last.num_loaded_tokens == bad * 16
        assert torch.equal(out, plain(model, second))
    finally:
        store.close()
        kv.close()


def test_drop_in_patch_and_batch_bypass(smollm2, tmp_path):
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, QUESTIONS[0])
    expected = plain(model, ids)
    kv = enable_kvtier(model, StoreSpec(path=str(tmp_path)))
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
        assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
        assert kv.last.num_loaded_tokens == (ids.shape[-1] - 1) // 16 * 16
        model.generate(torch.cat([ids, ids]), max_new_tokens=2, do_sample=False)
        assert kv.last.bypassed
    finally:
        del model.generate  # back to the class's generate
        kv.close()


def test_block_layout_round_trip(smollm2):
    model, _ = smollm2
    cfg = model.config
    L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    blocks = torch.randn(3, L, 2, 16, H, D)
    cache = blocks_to_cache(blocks, cfg)
    assert cache.get_seq_length() == 48
    # token 17 of the cache is token 1 of block 1; layer 5's V, head 2
    assert torch.equal(cache.layers[5].values[0, 2, 17], blocks[1, 5, 1, 1, 2])
    assert torch.equal(cache_to_blocks(cache, 3, 16), blocks)


@pytest.mark.timeout(300)
def test_a_second_process_loads_the_prefix_the_first_computed(smollm2, kvtier_daemon, run_instance):
    """The child instance gets the daemon's token from $KVTIER_TOKEN, this one from its spec."""
    model, tokenizer = smollm2
    first, second = (prompt_ids(tokenizer, q) for q in QUESTIONS)
    child = run_instance(os.path.join(os.path.dirname(__file__), "hf_instance.py"),
                         {"prompt": first[0].tolist(), "new_tokens": 2, "url": kvtier_daemon.url},
                         env={"KVTIER_TOKEN": kvtier_daemon.token})
    assert child["stats"]["num_loaded_tokens"] == 0 and child["stats"]["num_saved_blocks"] > 0
    kv = KVTierGenerate(model, StoreSpec(url=kvtier_daemon.url, token=kvtier_daemon.token))
    try:
        out = kv.generate(second, max_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        kv.close()
    shared = next(i for i, (a, b) in enumerate(zip(first[0], second[0])) if a != b)
    assert kv.last.num_loaded_tokens == shared // 16 * 16 > 200
    assert torch.equal(out, plain(model, second))


def test_a_wrong_daemon_token_is_refused(smollm2, kvtier_daemon):
    model, _ = smollm2
    with pytest.raises(Exception, match="bad or missing token"):
        KVTierGenerate(model, StoreSpec(url=kvtier_daemon.url, token="not-the-token"))


def test_padded_calls_bypass_so_the_same_ids_unpadded_get_their_own_kv(smollm2, tmp_path):
    """KV depends on the attention mask (left padding shifts every position), a block hash
    only on the ids: a padded call neither loads nor saves, so the same ids unpadded later
    match a plain generate (they used to load the padded call's KV and diverge)."""
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, QUESTIONS[0])
    pad = torch.full((1, 21), tokenizer.pad_token_id or 0, dtype=ids.dtype)
    padded = torch.cat([pad, ids], dim=1)
    mask = torch.cat([torch.zeros_like(pad), torch.ones_like(ids)], dim=1)
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)))
    try:
        out = kv.generate(padded, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert kv.last.bypassed and kv.last.num_saved_blocks == 0
        assert torch.equal(out, model.generate(padded, attention_mask=mask,
                                               max_new_tokens=NEW_TOKENS, do_sample=False))
        assert torch.equal(kv.generate(padded, max_new_tokens=NEW_TOKENS, do_sample=False),
                           plain(model, padded))
        assert not kv.last.bypassed
        ones = torch.ones_like(ids)  # an all-ones mask changes nothing: offloaded as usual
        kv.generate(ids, attention_mask=ones, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert not kv.last.bypassed
    finally:
        kv.close()


def test_inputs_embeds_are_generated_plainly(smollm2, tmp_path):
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, QUESTIONS[1])
    embeds = model.get_input_embeddings()(ids)
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)))
    try:
        out = kv.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False)
        assert kv.last.bypassed
        assert torch.equal(out, model.generate(inputs_embeds=embeds, max_new_tokens=4,
                                               do_sample=False))
    finally:
        kv.close()


def test_a_sliding_window_model_is_generated_plainly(tmp_path):
    """A sliding-window layer keeps only its window, so its cache cannot be cut into
    prefix blocks (this used to crash after generating, the output lost)."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=8)
    model = MistralForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (1, 40))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)), model_id="tiny-mistral")
    try:
        assert torch.equal(kv.generate(ids, max_new_tokens=6, do_sample=False), expected)
        assert kv.last.bypassed
    finally:
        kv.close()


def test_models_of_one_name_share_kv_only_when_their_weights_are_equal(tmp_path):
    """Two checkpoints under one model_id (a retrained one in the same place): the second
    must compute its own KV, never load the first's; a copy of the first loads it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(1)
    old = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(2)
    retrained = LlamaForCausalLM(cfg).eval()
    copy = LlamaForCausalLM(cfg).eval()
    copy.load_state_dict(old.state_dict())
    ids = torch.randint(0, 96, (1, 48))
    spec = StoreSpec(path=str(tmp_path))
    runs = {}
    for name, model in (("old", old), ("retrained", retrained), ("copy", copy)):
        expected = model.generate(ids, max_new_tokens=4, do_sample=False)
        kv = KVTierGenerate(model, spec, model_id="m")
        try:
            assert torch.equal(kv.generate(ids, max_new_tokens=4, do_sample=False), expected)
            runs[name] = (kv.ns.revision, kv.last.num_loaded_tokens)
        finally:
            kv.close()
    assert runs["old"][1] == 0 and runs["retrained"][1] == 0
    assert runs["retrained"][0] != runs["old"][0]
    assert runs["copy"] == (runs["old"][0], 32)  # two 16-token blocks of the 48 loaded
    # the caller may vouch for the weights itself: one name then, whatever the bytes
    # the same weights run with another rope: other KV, another namespace
    cfg2 = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5)
    rope = LlamaForCausalLM(cfg2).eval()
    rope.load_state_dict(old.state_dict())
    assert namespace_for(rope, "m").revision != runs["old"][0]
    named = [namespace_for(m, "m", revision="v7") for m in (old, retrained)]
    assert named[0] == named[1] and named[0].revision == "v7"


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("widen", [dict(num_beams=3), dict(num_return_sequences=3, do_sample=True),
                                   dict(generation_config="beams")],
                         ids=["num_beams", "num_return_sequences", "a beam config"])
def test_calls_that_generate_more_than_one_sequence_are_generated_plainly(tmp_path, widen):
    """Beam search and num_return_sequences widen the batch inside generate: row 0 of the
    cache was saved under the hashes of the best sequence (another beam's KV: a later
    greedy call on that text loaded it and diverged from plain generate), and a second such
    call, its prefix stored, crashed in transformers (a one-row cache met three rows)."""
    from transformers import GenerationConfig
    model = _tiny_llama()
    if widen.get("generation_config") == "beams":  # (the widening in a config, not kwargs)
        widen = dict(generation_config=GenerationConfig(num_beams=3, max_new_tokens=10,
                                                        pad_token_id=0))
    ids = torch.randint(1, 300, (1, 21), generator=torch.Generator().manual_seed(3))
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)), model_id="tiny-llama",
                        block_tokens=3)
    args = dict(max_new_tokens=10, **widen)
    try:
        with torch.no_grad():
            for _ in range(2):  # (the second call crashed once the first stored the prefix)
                torch.manual_seed(1)
                out = kv.generate(ids, **args)
                assert kv.last.bypassed and kv.last.num_saved_blocks == 0
                torch.manual_seed(1)
                assert torch.equal(out, model.generate(ids, **args))
            longer = out[:1]  # a greedy call on what the widened one wrote: its own KV
            assert torch.equal(kv.generate(longer, max_new_tokens=5, do_sample=False),
                               model.generate(longer, max_new_tokens=5, do_sample=False))
            assert not kv.last.bypassed and kv.last.num_loaded_tokens == 0
    finally:
        kv.close()



def test_calls_with_their_own_positions_neither_save_nor_load(tmp_path):
    """position_ids change the keys (RoPE) but not the token ids: a call with its own was
    saved under the ids' hashes, and later plain calls on the same ids loaded that KV and
    generated something else than plain generate."""
    model = _tiny_llama()
    ids = torch.randint(1, 300, (1, 40), generator=torch.Generator().manual_seed(4))
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)), model_id="tiny", block_tokens=8)
    try:
        with torch.no_grad():
            shifted = dict(position_ids=torch.arange(40)[None] + 300, max_new_tokens=1,
                           do_sample=False)
            assert torch.equal(kv.generate(ids, **shifted), model.generate(ids, **shifted))
            assert kv.last.bypassed and kv.last.num_saved_blocks == 0
            out = kv.generate(ids, max_new_tokens=6, do_sample=False)
            assert kv.last.num_loaded_tokens == 0
            assert torch.equal(out, model.generate(ids, max_new_tokens=6, do_sample=False))
    finally:
        kv.close()


def test_generation_configs_are_honoured(tmp_path):
    """return_dict_in_generate set in a GenerationConfig was not looked at (a bare tensor
    came back), and a cache_implementation, passed or in the model's generation config,
    failed every call ('Passing both cache_implementation and cache')."""
    from transformers import GenerationConfig
    model = _tiny_llama()
    ids = torch.randint(1, 300, (1, 30), generator=torch.Generator().manual_seed(5))
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)), model_id="tiny", block_tokens=8)
    try:
        with torch.no_grad():
            config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0,
                                      return_dict_in_generate=True)
            for _ in range(2):  # (saved, then loaded)
                out = kv.generate(ids, generation_config=config)
                ref = model.generate(ids, generation_config=config)
                assert type(out) is type(ref) and torch.equal(out.sequences, ref.sequences)
            assert kv.last.num_loaded_tokens > 0
            for how in (dict(cache_implementation="dynamic"),
                        dict(cache_implementation="static")):
                args = dict(max_new_tokens=4, do_sample=False, **how)
                assert torch.equal(kv.generate(ids, **args), model.generate(ids, **args))
            model.generation_config.cache_implementation = "dynamic"  # (a checkpoint's:
            args = dict(max_new_tokens=4, do_sample=False)  # generated plainly)
            assert torch.equal(kv.generate(ids, **args), model.generate(ids, **args))
    finally:
        model.generation_config.cache_implementation = None
        kv.close()


def test_a_store_that_cannot_answer_costs_the_loads_never_the_output(tmp_path):
    """A daemon gone before a call failed it at match_prefix; one killed during a call (its
    tokens all generated) failed it at the save, and the output was lost."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from kvstore.daemon.process import DaemonProcess
    model = _tiny_llama()
    ids = torch.randint(1, 300, (1, 30), generator=torch.Generator().manual_seed(6))
    d = DaemonProcess(str(tmp_path / "data"), dram_size="64MiB", ssd_size="0",
                      cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    d.start()
    kv = KVTierGenerate(model, StoreSpec(url=d.url), model_id="tiny", block_tokens=8)

    class KillTheDaemon(StoppingCriteria):  # after the first new token: mid-call
        def __call__(self, input_ids, scores, **kw):
            d.kill()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    try:
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=5, do_sample=False)
            out = kv.generate(ids, max_new_tokens=5, do_sample=False,
                              stopping_criteria=StoppingCriteriaList([KillTheDaemon()]))
            assert torch.equal(out, ref) and kv.last.num_saved_blocks == 0
            assert torch.equal(kv.generate(ids, max_new_tokens=5, do_sample=False), ref)
            assert kv.last.num_loaded_tokens == 0  # (the daemon is gone: all computed)
    finally:
        kv.close()
        d.close()


def test_a_call_with_use_cache_off_is_generated_plainly_and_saves_nothing(tmp_path):
    """use_cache=False: generate recomputes the whole sequence each step and appended every
    pass to the cache the wrapper passed, whose positions 0..N then held the second pass's
    KV of tokens 0, 1, ... saved under the hashes of tokens 0..N: the call's output and a
    later cached call that loaded those blocks both differed from plain generate."""
    model = _tiny_llama()
    ids = torch.randint(1, 300, (1, 40), generator=torch.Generator().manual_seed(5))
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)), model_id="tiny", block_tokens=8)
    args = dict(max_new_tokens=10, do_sample=False)
    try:
        with torch.no_grad():
            out = kv.generate(ids, use_cache=False, **args)
            assert kv.last.bypassed and kv.last.num_saved_blocks == 0
            assert torch.equal(out, model.generate(ids, use_cache=False, **args))
            follow = torch.cat([out, ids[:, :6]], dim=1)
            assert torch.equal(kv.generate(follow, **args), model.generate(follow, **args))
            assert kv.last.num_loaded_tokens == 0
    finally:
        kv.close()


def _tiny_llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, \
        LlavaForConditionalGeneration
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, image_size=16, patch_size=8,
                              projection_dim=32)
    text = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256)
    model = LlavaForConditionalGeneration(LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=120,
        vision_feature_select_strategy="full", vision_feature_layer=-1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.generation_config.pad_token_id = 0
    return model


def test_a_call_with_an_image_is_generated_plainly(tmp_path):
    """An image's KV is not a function of the token ids (its placeholders are one id): the
    first image's KV was saved under the ids' hashes, a second image's call then failed in
    transformers, and a text call on the same ids was handed the first image's KV."""
    model = _tiny_llava()
    ids = torch.tensor([[1] + [120] * 5 + list(range(10, 60))])
    images = torch.randn(2, 1, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    args = dict(max_new_tokens=8, do_sample=False)
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)), model_id="tiny-llava",
                        block_tokens=8)
    try:
        with torch.no_grad():
            for image in images:
                out = kv.generate(ids, pixel_values=image, **args)
                assert kv.last.bypassed and kv.last.num_saved_blocks == 0
                assert torch.equal(out, model.generate(ids, pixel_values=image, **args))
            assert torch.equal(kv.generate(ids, **args), model.generate(ids, **args))
            assert not kv.last.bypassed and kv.last.num_loaded_tokens == 0
    finally:
        kv.close()


def _odd_cache_model(kind: str):
    import transformers as T
    torch.manual_seed(0)
    if kind == "conv-hybrid":  # LFM2: short-convolution layers beside attention ones
        model = T.Lfm2ForCausalLM(T.Lfm2Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv", "full_attention"]))
    else:  # DeepSeek-V3's MLA: K and V of two widths (48, 32)
        model = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1))
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("kind", ["conv-hybrid", "mla"])
def test_a_model_whose_cache_is_not_plain_kv_blocks_keeps_its_output(tmp_path, kind):
    """A cache of more than per-layer K/V (LFM2's conv state) or of K and V of two widths
    (MLA): each call failed after generating (its output lost), and a hybrid model's
    loaded prefix lacked its SSM state (other tokens). Now such a model is generated
    plainly, or its blocks are not saved, and every call's output is plain generate's."""
    model = _odd_cache_model(kind)
    ids = torch.randint(3, 128, (1, 45), generator=torch.Generator().manual_seed(1))
    args = dict(max_new_tokens=6, do_sample=False)
    kv = KVTierGenerate(model, StoreSpec(path=str(tmp_path)), model_id=f"tiny-{kind}",
                        block_tokens=8)
    try:
        with torch.no_grad():
            want = model.generate(ids, **args)
            for _ in range(2):
                assert torch.equal(kv.generate(ids, **args), want)
                assert kv.last.num_saved_blocks == 0 and kv.last.num_loaded_tokens == 0
            assert kv.last.bypassed == (kind == "conv-hybrid")
    finally:
        kv.close()
