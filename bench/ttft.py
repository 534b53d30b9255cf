"""TTFT with the prompt's prefix fetched from the store vs recomputing it, and decode
throughput, on SmolLM2-135M (CPU). Baselines measured in the same run: our own recompute
(for store hits) and transformers `generate` on the same model and prompts.

    python bench/ttft.py [--quick] [--lengths 512,1024,2048] [--json out.json] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
# the repo root first: bench/kernels.py must not shadow the kernels package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import Row, add_common_args, report  # noqa: E402

from engine_adapter.config import EngineConfig  # noqa: E402
from engine_adapter.engine import LLMEngine  # noqa: E402
from engine_adapter.loader import from_transformers, load_hf_gguf  # noqa: E402
from engine_adapter.sampling import SamplingParams  # noqa: E402
from kvstore.config import StoreConfig, TierConfig  # noqa: E402
from kvstore.store import TieredStore  # noqa: E402

FIRST = SamplingParams(temperature=0, max_tokens=1)


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def engine_config(num_tokens: int, batch: int = 1) -> EngineConfig:
    # prefix caching off: every run starts cold locally, so a hit can only come from the store
    return EngineConfig(num_blocks=batch * (num_tokens // 16 + 8), max_num_batched_tokens=max(num_tokens, 512),
                        max_num_seqs=max(batch, 1), enable_prefix_caching=False)


def ttft_rows(hf, model, prompt: list[int], repeats: int, ssd_dir: str) -> list[Row]:
    n, cfg = len(prompt), engine_config(len(prompt))
    ours = LLMEngine(model, cfg)
    recompute = best_of(lambda: ours.generate([prompt], FIRST), repeats)
    with torch.no_grad():
        hf.generate(torch.tensor([prompt[:16]]), max_new_tokens=1, do_sample=False)  # warm up
        hf_ttft = best_of(lambda: hf.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False), repeats)
    rows = [Row(f"ttft {n} tok recompute", "s", recompute, "transformers generate", hf_ttft)]
    blocks = n // 16 + 2
    for tier, tiers in (("dram", (TierConfig("dram", blocks),)),
                        ("ssd", (TierConfig("ssd", blocks, path=os.path.join(ssd_dir, str(n))),))):
        with TieredStore(ours.ns, StoreConfig(tiers=tiers, promote_on_hit=False)) as store:
            engine = LLMEngine(model, cfg, store=store)
            engine.generate([prompt], FIRST)
            engine.connector.flush()  # the prefix is in the store before timing
            hit = best_of(lambda: engine.generate([prompt], FIRST), repeats)
            engine.close()
        rows.append(Row(f"ttft {n} tok prefix hit ({tier}, in-process)", "s", hit, "our recompute", recompute))
    return rows


def decode_rows(hf, model, prompt: list[int], batch: int, new_tokens: int) -> list[Row]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine = LLMEngine(model, engine_config(len(prompt) + new_tokens, batch))
    prompts = [prompt] * batch
    engine.generate(prompts, FIRST)  # warm up
    t = time.perf_counter()
    engine.generate(prompts, params)
    ours = batch * new_tokens / (time.perf_counter() - t)
    with torch.no_grad():
        hf.generate(torch.tensor(prompts), max_new_tokens=1, do_sample=False)  # warm up
        t = time.perf_counter()
        hf.generate(torch.tensor(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        theirs = batch * new_tokens / (time.perf_counter() - t)
    return [Row(f"decode batch {batch}, {len(prompt)}-tok prompt, {new_tokens} new (incl. prefill)",
                "tok/s", ours, "transformers generate", theirs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--quick", action="store_true", help="short prompts, one repeat (< 1 min)")
    parser.add_argument("--lengths", help="prompt lengths in tokens, comma separated")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case (best is kept)")
    args = parser.parse_args()
    lengths = [int(x) for x in (args.lengths or ("256,512" if args.quick else "512,1024,2048")).split(",")]
    repeats = args.repeats or (1 if args.quick else 2)
    torch.manual_seed(args.seed)
    hf, _ = load_hf_gguf()
    model = from_transformers(hf, name="HuggingFaceTB/SmolLM2-135M-Instruct")
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as ssd_dir:
        for n in lengths:
            prompt = torch.randint(100, hf.config.vocab_size, (n,), generator=gen).tolist()
            rows += ttft_rows(hf, model, prompt, repeats, ssd_dir)
    prompt = torch.randint(100, hf.config.vocab_size, (64,), generator=gen).tolist()
    new_tokens = 16 if args.quick else 32
    for batch in (1, 8):
        rows += decode_rows(hf, model, prompt, batch, new_tokens)
    report("ttft", rows, args.json)


if __name__ == "__main__":
    main()
