"""Compressed KV blocks on SmolLM2-135M (fp32 cache): bytes, speed and output quality of
each codec against the raw cache, and full-prefix hit TTFT through `kvtier serve`, all
measured in the same run (docs/compression.md).

Prompts: the source files of 32 Python standard-library modules (module docstrings first,
then code and comments; the text ships with every CPython under the PSF license), read
from this interpreter's own stdlib, each cut to a length between 512 and 2048 tokens.

Quality: per prompt, transformers prefills it and greedily continues it by `--new-tokens`
(the raw run). Its full blocks go through an in-process store of each codec's namespace
(encoded on put, decoded on get) and the raw continuation is fed back after that prefix
(teacher forcing): top-1 agreement with the raw run, mean KL(raw || codec) per token and
the relative NLL change of the continuation. Free-running greedy agreement (the fraction of
positions equal to the raw continuation) is informational, over `--greedy-prompts`.
Speed: encode/decode GB/s of model bytes, against memcpy of the same bytes. TTFT: our
engine with a full-prefix hit over TCP (DRAM daemon) and from an SSD-only daemon
(`--dram-size 0`; a warm page cache), compressed vs raw, taking turns in every repeat.

    python -m bench.compression [--prompts 32] [--new-tokens 64] [--greedy-prompts 4]
        [--prompt-tokens 512,2048] [--lengths 2048,4096] [--repeats 3]
        [--codecs int8,fp8_e4m3,zstd] [--json PATH]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from kvtier.report import Row, add_common_args, report

from engine_adapter import kvquality
from engine_adapter.config import EngineConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.kvcodec import BlockCodec
from engine_adapter.loader import from_transformers, load_hf_gguf
from engine_adapter.plugins.base import coded
from engine_adapter.plugins.hf import cache_to_blocks, namespace_for
from engine_adapter.sampling import SamplingParams
from kvstore.client import Client
from kvstore.config import StoreConfig, TierConfig
from kvstore.daemon.process import DaemonProcess
from kvstore.keys import hash_blocks
from kvstore.store import TieredStore
from transfer.copy import copy_bytes

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BT = 16
FIRST = SamplingParams(temperature=0, max_tokens=1)
MODULES = ("argparse", "calendar", "collections", "contextlib", "csv", "dataclasses", "datetime",
           "difflib", "doctest", "enum", "fractions", "functools", "gettext", "heapq", "inspect",
           "ipaddress", "locale", "logging", "mailbox", "optparse", "pathlib", "pickle", "pprint",
           "random", "shlex", "shutil", "statistics", "string", "subprocess", "tarfile",
           "textwrap", "threading", "typing", "uuid", "zipfile")


def stdlib_text(name: str) -> str:
    with open(importlib.util.find_spec(name).origin, encoding="utf-8") as f:
        return f.read()


def corpus_prompts(tokenizer, num: int, lo: int, hi: int) -> list[torch.Tensor]:
    """`num` prompts, one module each, lengths spread evenly over [lo, hi] tokens."""
    if num > len(MODULES):
        raise SystemExit(f"--prompts is at most {len(MODULES)} (one stdlib module each)")
    out = []
    for i, name in enumerate(MODULES[:num]):
        ids = tokenizer(stdlib_text(name), return_tensors="pt").input_ids[0]
        want = lo + (hi - lo) * i // max(num - 1, 1)
        if len(ids) < want:
            raise SystemExit(f"{name}.py has {len(ids)} tokens, fewer than {want}")
        out.append(ids[:want])
    return out


# ---------------------------------------------------------------------------- quality


def quality_rows(hf, prompts, codecs, new_tokens: int, greedy_prompts: int) -> tuple[list[Row], torch.Tensor]:
    spaces = {c: namespace_for(hf, MODEL_ID, BT, codec=c) for c in ("raw", *codecs)}
    stores = {c: coded(TieredStore(ns, StoreConfig((TierConfig("dram", 2 * 2048 // BT),))), ns)
              for c, ns in spaces.items()}
    total = {c: kvquality.Quality(0, 0, 0.0, 0.0, 0.0) for c in codecs}
    greedy = {c: [] for c in codecs}
    sample = None
    for i, ids in enumerate(prompts):
        num_blocks = (len(ids) - 1) // BT  # at least one prompt token is fed, not cached
        with torch.inference_mode():
            out = hf.generate(ids.unsqueeze(0), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, return_dict_in_generate=True)
        cont = out.sequences[0, len(ids):]
        blocks = cache_to_blocks(out.cache, num_blocks, BT)
        sample = blocks  # the longest prompt's, for the speed rows
        feed = torch.cat([ids[num_blocks * BT:], cont[:-1]])
        prefix = ids[:num_blocks * BT].tolist()
        loaded = {c: through_store(stores[c], hash_blocks(spaces[c], prefix), blocks) for c in stores}
        raw = kvquality.prefix_logits(hf, loaded["raw"], feed)[-new_tokens:]
        for c in codecs:
            got = kvquality.prefix_logits(hf, loaded[c], feed)[-new_tokens:]
            total[c] = total[c] + kvquality.compare(raw, got, cont)
            if i < greedy_prompts and c != "zstd":  # zstd is lossless: nothing to see
                run = kvquality.greedy(hf, loaded[c], ids[num_blocks * BT:], new_tokens)
                greedy[c].append(float((run == cont).float().mean()))
        print(f"prompt {i}: {len(ids)} tokens, " + ", ".join(
            f"{c} agree {total[c].agreement:.4f} kl {total[c].mean_kl:.2e}" for c in codecs), flush=True)
    for store in stores.values():
        store.close()
    return quality_table(total, greedy, len(prompts), new_tokens), sample


def through_store(store, hashes: list[bytes], blocks: torch.Tensor) -> torch.Tensor:
    """Put the prefix's blocks into `store` and get them back (decoded)."""
    assert all(s.value in ("stored", "exists") for s in store.put_n(hashes, blocks.contiguous())), \
        "a block was not stored"
    back = torch.empty_like(blocks)
    assert all(t is not None for t in store.get_n(hashes, back)), "a stored block was not found"
    return back


def quality_table(total, greedy, num_prompts: int, new_tokens: int) -> list[Row]:
    rows = []
    for c, q in total.items():
        rows += [Row(f"{c} teacher-forced top-1 agreement ({num_prompts} prompts x {new_tokens})",
                     "fraction", q.agreement, "raw", 1.0),
                 Row(f"{c} mean KL (raw || {c})", "nats/token", q.mean_kl),
                 Row(f"{c} NLL change", "relative", q.nll_change, "raw NLL/token", q.nll_raw / q.num_tokens)]
        if greedy[c]:
            rows.append(Row(f"{c} free-running greedy agreement ({len(greedy[c])} prompts x {new_tokens})",
                            "fraction", sum(greedy[c]) / len(greedy[c]), "raw", 1.0))
    return rows


# ---------------------------------------------------------------------------- bytes, speed


def size_and_speed_rows(blocks: torch.Tensor, codecs, repeats: int) -> list[Row]:
    raw = BlockCodec("raw", tuple(blocks.shape[1:]), blocks.dtype)
    src, dst = blocks.contiguous(), torch.empty_like(blocks)
    nbytes = src.numel() * src.element_size()
    memcpy = nbytes / best(lambda: copy_bytes(dst, src), repeats) / 1e9
    ids = torch.arange(blocks.shape[0])
    rows = []
    for c in codecs:
        codec = BlockCodec(c, tuple(blocks.shape[1:]), blocks.dtype)
        encoded, keep = codec.encode(src)
        rows.append(Row(f"{c} bytes per block", "bytes", codec.block_bytes, "raw", raw.block_bytes))
        if c == "zstd":
            used = [int.from_bytes(bytes(r[:4].tolist()), "little") for r in encoded]
            rows.append(Row("zstd frame bytes per block (mean; the slot moves)", "bytes",
                            sum(used) / len(used), "raw", raw.block_bytes))
            rows.append(Row("zstd blocks too big for their slot (not stored)", "fraction",
                            keep.count(False) / len(keep)))
        enc_s = best(lambda: codec.encode(src), repeats)
        dec_s = best(lambda: codec.decode(encoded, dst, ids), repeats)
        rows += [Row(f"{c} encode", "GB/s", nbytes / enc_s / 1e9, "memcpy", memcpy),
                 Row(f"{c} decode", "GB/s", nbytes / dec_s / 1e9, "memcpy", memcpy)]
    return rows


def best(fn, repeats: int) -> float:
    fn()  # warm up (first touch of the output buffers)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


# ---------------------------------------------------------------------------- TTFT


def ttft_rows(hf, model, tokenizer, codecs, lengths, repeats: int, tmp: str) -> list[Row]:
    """Full-prefix hits at each length, over TCP (DRAM daemon) and from an SSD-only daemon."""
    tokens = tokenizer("\n".join(stdlib_text(m) for m in MODULES[:8]), return_tensors="pt").input_ids[0]
    longest = max(lengths)
    assert len(tokens) > longest and hf.config.max_position_embeddings > longest
    with torch.inference_mode():
        cache = hf(tokens[:longest].unsqueeze(0), use_cache=True).past_key_values
    blocks = cache_to_blocks(cache, longest // BT, BT)
    # sizes are per namespace (one per codec); the DRAM arena is pre-faulted, so just enough
    dram = f"{(longest // BT + 16) * blocks[0].numel() * blocks.element_size() >> 20}MiB"
    tcp = DaemonProcess(os.path.join(tmp, "tcp"), dram_size=dram, ssd_size="0").start()
    ssd = DaemonProcess(os.path.join(tmp, "ssd"), dram_size="0", ssd_size="1GiB").start()
    try:
        rows = []
        for tier, daemon, use_shm in (("tcp", tcp, False), ("ssd", ssd, True)):
            engines = {c: hit_engine(model, c, daemon.url, use_shm, longest) for c in ("raw", *codecs)}
            for engine in engines.values():
                publish(engine, tokens[:longest].tolist(), blocks)
            for n in lengths:
                times = timed_hits(engines, tokens[:n + 1].tolist(), repeats)
                rows += [Row(f"{c} {n} {tier} hit TTFT", "s", times[c], f"raw {n} {tier} hit TTFT", times["raw"])
                         for c in codecs]
            for engine in engines.values():
                engine.close()
                engine.connector.store.close()
        return rows
    finally:
        tcp.close()
        ssd.close()


def hit_engine(model, codec: str, url: str, use_shm: bool, longest: int) -> LLMEngine:
    cfg = EngineConfig(num_blocks=longest // BT + 8, max_num_batched_tokens=max(longest, 512),
                       max_num_seqs=1, enable_prefix_caching=False, kv_codec=codec)
    ns = LLMEngine(model, EngineConfig(num_blocks=1, kv_codec=codec)).ns
    return LLMEngine(model, cfg, store=Client(url, namespace=ns, use_shm=use_shm, timeout_s=300))


def publish(engine: LLMEngine, tokens: list[int], blocks: torch.Tensor) -> None:
    """The prefix's real KV blocks, encoded for the engine's codec, into its store."""
    hashes = hash_blocks(engine.ns, tokens)
    store = coded(engine.connector.store, engine.ns)
    for lo in range(0, len(hashes), 64):  # bounded frames
        store.put_n(hashes[lo:lo + 64], blocks[lo:lo + 64].contiguous())
    assert engine.connector.store.match_prefix(hashes).num_blocks == len(hashes), "not all stored"


def timed_hits(engines: dict, prompt: list[int], repeats: int) -> dict[str, float]:
    """Best TTFT of a full-prefix hit per engine, the engines taking turns in every repeat
    (a load change on this shared machine hits each alike). Each engine's save queue is
    drained outside the timed part."""
    best_s = {c: float("inf") for c in engines}
    for engine in engines.values():  # warm up: first-block hit
        engine.generate([prompt[:BT + 1]], FIRST)
        engine.connector.flush()
    for _ in range(repeats):
        for c, engine in engines.items():
            t = time.perf_counter()
            out = engine.generate([prompt], FIRST)[0]
            best_s[c] = min(best_s[c], time.perf_counter() - t)
            engine.connector.flush()
            assert out.num_loaded_tokens == (len(prompt) - 1) // BT * BT, f"{c}: not a full-prefix hit"
    return best_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", default="512,2048", help="shortest,longest prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--greedy-prompts", type=int, default=4, help="free-running runs (slow)")
    parser.add_argument("--lengths", default="2048,4096", help="TTFT prefix lengths, tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--codecs", default="int8,fp8_e4m3,zstd")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    codecs = args.codecs.split(",")
    print(f"load average at start: {os.getloadavg()} on {os.cpu_count()} cpus, torch threads "
          f"{torch.get_num_threads()}", flush=True)
    hf, tokenizer = load_hf_gguf()
    hf.eval()
    lo, hi = (int(n) for n in args.prompt_tokens.split(","))
    prompts = corpus_prompts(tokenizer, args.prompts, lo, hi)
    rows, sample = quality_rows(hf, prompts, codecs, args.new_tokens, args.greedy_prompts)
    rows = size_and_speed_rows(sample[:64], codecs, args.repeats) + rows
    model = from_transformers(hf, name=MODEL_ID)
    with tempfile.TemporaryDirectory() as tmp:
        rows += ttft_rows(hf, model, tokenizer, codecs, [int(n) for n in args.lengths.split(",")],
                          args.repeats, tmp)
    print(f"load average at end: {os.getloadavg()}")
    report("compression", rows, args.json)


if __name__ == "__main__":
    main()
