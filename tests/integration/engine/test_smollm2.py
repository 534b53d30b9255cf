"""SmolLM2-135M: logits and greedy generation vs transformers; store offload end to end."""
import torch

from engine_adapter.config import EngineConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.sampling import SamplingParams
from kvstore.config import StoreConfig, TierConfig
from kvstore.events import TierKind
from kvstore.store import TieredStore

CFG = EngineConfig(num_blocks=64, block_tokens=16, max_num_batched_tokens=512)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in one sentence why the sky is blue."]


def chat(tokenizer, question):
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text)["input_ids"]


def test_prefill_decode_and_cached_prefix_logits_match_transformers(smollm2):
    hf, model, tok = smollm2
    prompt = chat(tok, QUESTIONS[2])
    engine = LLMEngine(model, CFG, tokenizer=tok, record_logits=True)
    steps = 4
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    again = engine.generate([prompt], params)[0]  # prefix from the engine's own cache
    assert again.num_local_hit_tokens > 0 and again.token_ids == first.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + first.token_ids])).logits[0, len(prompt) - 1:-1]  # [steps, V]
    for out in (first, again):
        got = torch.stack(engine.logits[out.request_id])  # [steps, V]: prefill, then decodes
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers_generate(smollm2):
    hf, model, tok = smollm2
    prompts = [chat(tok, q) for q in QUESTIONS]
    ours = LLMEngine(model, CFG, tokenizer=tok).generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
        assert out.token_ids == ref.tolist()
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)  # incremental == whole


def test_incremental_text_matches_the_tokenizer_on_multibyte_text(smollm2):
    hf, model, tok = smollm2
    engine = LLMEngine(model, CFG, tokenizer=tok)
    ids = tok("Grüße, 東京 🙂 — naïve café <|im_end|> done")["input_ids"]
    req = engine.add_request([1, 2, 3], SamplingParams(max_tokens=len(ids)))
    for tok_id in ids:
        req.token_ids.append(tok_id)
        engine._detokenize_step(req)
    assert req.text == tok.decode(ids, skip_special_tokens=True)


def test_a_fresh_engine_loads_the_prefix_from_a_reopened_ssd_store(smollm2, tmp_path):
    hf, model, tok = smollm2
    system = "You are a careful assistant. Answer briefly and precisely. " * 6
    prompt = tok(system + QUESTIONS[0])["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=8)
    first = LLMEngine(model, CFG, tokenizer=tok, record_logits=True)
    base = first.generate([prompt], params)[0]
    tiers = (TierConfig("dram", 32), TierConfig("ssd", 256, path=str(tmp_path)))
    with TieredStore(first.ns, StoreConfig(tiers=tiers)) as store:
        saver = LLMEngine(model, CFG, tokenizer=tok, store=store)
        saver.generate([prompt], params)
        saver.close()
    with TieredStore(first.ns, StoreConfig(tiers=tiers)) as store:
        fresh = LLMEngine(model, CFG, tokenizer=tok, store=store, record_logits=True)
        out = fresh.generate([prompt], params)[0]
        fresh.close()
    full = (len(prompt) - 1) // 16 * 16
    assert out.num_loaded_tokens == full and out.num_model_tokens == len(prompt) - full + 7
    assert out.token_ids == base.token_ids and out.text == base.text
    for x, y in zip(fresh.logits[out.request_id], first.logits[base.request_id]):
        torch.testing.assert_close(x, y, atol=2e-4, rtol=1e-4)
