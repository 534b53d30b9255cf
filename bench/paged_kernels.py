"""Paged KV kernels: time, achieved GB/s and the fraction of the copy bandwidth measured in
the same run, against torch SDPA over the same K/V already gathered densely.

On a CUDA device it runs the Triton kernels at full size (Llama-3-8B-like: 32 heads, 8 KV
heads, head_dim 128, block 16, fp16). Without one it runs the torch reference (the CPU
path) on small shapes and says so. Never asserts.

    python bench/kernels.py [--quick] [--seed N] [--json PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from kvtier.report import Row, add_common_args, report

from kernels import cache as kv_cache


class Config(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    num_layers: int  # for gather/scatter blocks
    repeats: int
    decode: list[tuple[int, int]]  # (batch, context tokens)
    prefill: list[tuple[int, int, int]]  # (batch, context tokens, new query tokens)
    blocks: list[int]  # blocks per gather/scatter
    copy_bytes: int


def make_config(quick: bool) -> Config:
    if torch.cuda.is_available():
        decode = [(1, 1024), (1, 32768), (16, 4096), (64, 1024), (64, 8192)]
        prefill = [(1, 4096, 512), (4, 2048, 2048)]
        if quick:
            decode, prefill = [(1, 32768), (64, 4096)], [(1, 4096, 512)]
        return Config(torch.device("cuda"), torch.float16, 32, 8, 128, 16, 32, 20 if quick else 50,
                      decode, prefill, [64] if quick else [16, 256], 1 << 30)
    decode = [(1, 1024), (8, 1024), (16, 2048)]
    prefill = [(1, 1024, 256), (4, 512, 128)]
    if quick:
        decode, prefill = [(1, 1024), (8, 1024)], [(1, 512, 128)]
    return Config(torch.device("cpu"), torch.float32, 8, 2, 64, 16, 16, 3 if quick else 7,
                  decode, prefill, [64] if quick else [64, 256], 64 << 20)


def measure(fn: Callable[[], object], cfg: Config) -> float:
    """Median seconds of `cfg.repeats` calls after a warm-up call."""
    fn()
    cuda = cfg.device.type == "cuda"
    times = []
    for _ in range(cfg.repeats):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(cfg: Config) -> float:
    """GB/s of a plain device copy (bytes read + bytes written), the roofline proxy."""
    src = torch.ones(cfg.copy_bytes // 4, dtype=torch.float32, device=cfg.device)
    dst = torch.empty_like(src)
    seconds = measure(lambda: dst.copy_(src), cfg._replace(repeats=max(cfg.repeats, 15)))
    return 2 * cfg.copy_bytes / seconds / 1e9


class Paged(NamedTuple):
    layer_cache: torch.Tensor  # [num_blocks, 2, bt, Hkv, D]
    block_tables: torch.Tensor  # [batch, blocks_per_seq] int32, random block order
    seq_lens: torch.Tensor  # [batch] int32
    k_dense: torch.Tensor  # [batch, Hkv, ctx, D] the same K gathered densely (SDPA baseline)
    v_dense: torch.Tensor


def make_paged(cfg: Config, batch: int, ctx: int, gen: torch.Generator) -> Paged:
    per_seq = -(-ctx // cfg.block_tokens)
    num_blocks = batch * per_seq
    full = kv_cache.allocate_kv_cache(num_blocks, 1, cfg.block_tokens, cfg.num_kv_heads, cfg.head_dim,
                                      cfg.dtype, cfg.device)
    layer = kv_cache.layer_view(full, 0)
    layer.normal_(generator=gen) if cfg.device.type == "cpu" else layer.normal_()
    perm = torch.randperm(num_blocks, generator=gen).to(cfg.device)
    tables = perm.view(batch, per_seq).to(torch.int32)  # [batch, per_seq]
    kv = layer[tables.long()]  # [batch, per_seq, 2, bt, Hkv, D]
    kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, cfg.num_kv_heads, per_seq * cfg.block_tokens, cfg.head_dim)
    kv = kv[..., :ctx, :].contiguous()  # [2, batch, Hkv, ctx, D]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=cfg.device)
    return Paged(layer, tables, seq_lens, kv[0], kv[1])


def attention_rows(label: str, ours: float, sdpa: float, nbytes: int, copy_gbs: float, sdpa_name: str) -> list[Row]:
    gbs = nbytes / ours / 1e9
    return [
        Row(f"{label} time", "ms", ours * 1e3, sdpa_name, sdpa * 1e3),
        Row(f"{label} bandwidth", "GB/s", gbs, "device copy", copy_gbs),
    ]


def bench_decode(ops, cfg: Config, gen: torch.Generator, copy_gbs: float) -> list[Row]:
    rows = []
    for batch, ctx in cfg.decode:
        p = make_paged(cfg, batch, ctx, gen)
        q = torch.randn(batch, cfg.num_heads, cfg.head_dim, device=cfg.device).to(cfg.dtype)
        out = torch.empty_like(q)
        ours = measure(lambda: ops.paged_decode_attention(q, p.layer_cache, p.block_tables, p.seq_lens,
                                                          out=out, check_values=False), cfg)
        q4 = q.unsqueeze(2)  # [batch, heads, 1, D]
        sdpa = measure(lambda: F.scaled_dot_product_attention(q4, p.k_dense, p.v_dense, enable_gqa=True), cfg)
        nbytes = 2 * p.k_dense.numel() * p.k_dense.element_size()  # K + V read once
        rows += attention_rows(f"decode b{batch} ctx{ctx}", ours, sdpa, nbytes, copy_gbs, "sdpa dense")
    return rows


def bench_prefill(ops, cfg: Config, gen: torch.Generator, copy_gbs: float) -> list[Row]:
    rows = []
    for batch, ctx, q_len in cfg.prefill:
        p = make_paged(cfg, batch, ctx, gen)
        q = torch.randn(batch * q_len, cfg.num_heads, cfg.head_dim, device=cfg.device).to(cfg.dtype)
        cu = torch.arange(0, batch + 1, device=cfg.device, dtype=torch.int32) * q_len  # [batch + 1]
        ours = measure(lambda: ops.paged_prefill_attention(q, p.layer_cache, p.block_tables, cu, p.seq_lens,
                                                           max_query_len=q_len, check_values=False), cfg)
        q4 = q.view(batch, q_len, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [batch, heads, q_len, D]
        pos = torch.arange(ctx, device=cfg.device)
        mask = pos[None, :] <= (ctx - q_len + torch.arange(q_len, device=cfg.device))[:, None]  # [q_len, ctx]
        sdpa = measure(lambda: F.scaled_dot_product_attention(q4, p.k_dense, p.v_dense, attn_mask=mask,
                                                              enable_gqa=True), cfg)
        nbytes = 2 * p.k_dense.numel() * p.k_dense.element_size() + 2 * q.numel() * q.element_size()
        rows += attention_rows(f"prefill b{batch} ctx{ctx} q{q_len}", ours, sdpa, nbytes, copy_gbs, "sdpa dense")
    return rows


def bench_copies(ops, cfg: Config, gen: torch.Generator, copy_gbs: float) -> list[Row]:
    rows = []
    for n in cfg.blocks:
        full = kv_cache.allocate_kv_cache(2 * n, cfg.num_layers, cfg.block_tokens, cfg.num_kv_heads,
                                          cfg.head_dim, cfg.dtype, cfg.device)
        ids = torch.randperm(2 * n, generator=gen)[:n].to(cfg.device)
        staging = torch.empty((n, *full.shape[1:]), dtype=cfg.dtype, device=cfg.device)
        nbytes = 2 * staging.numel() * staging.element_size()  # read + write
        block_mib = kv_cache.block_bytes(full) / 2**20
        t = measure(lambda: ops.gather_blocks(full, ids, out=staging, check_values=False), cfg)
        rows.append(Row(f"gather {n} blocks x {block_mib:.2g} MiB", "GB/s", nbytes / t / 1e9, "device copy", copy_gbs))
        t = measure(lambda: ops.scatter_blocks(staging, full, ids, check_values=False), cfg)
        rows.append(Row(f"scatter {n} blocks x {block_mib:.2g} MiB", "GB/s", nbytes / t / 1e9, "device copy", copy_gbs))
    layer = kv_cache.layer_view(full, 0)
    tokens = min(4096 if cfg.device.type == "cuda" else 1024, layer.shape[0] * cfg.block_tokens)
    slots = torch.randperm(layer.shape[0] * cfg.block_tokens, generator=gen)[:tokens].to(cfg.device)
    key = torch.randn(tokens, cfg.num_kv_heads, cfg.head_dim, device=cfg.device).to(cfg.dtype)
    value = torch.randn_like(key)
    t = measure(lambda: ops.write_kv_to_cache(key, value, layer, slots, check_values=False), cfg)
    nbytes = 4 * key.numel() * key.element_size()  # K and V, read + write
    rows.append(Row(f"write_kv {tokens} tokens", "GB/s", nbytes / t / 1e9, "device copy", copy_gbs))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    add_common_args(parser)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = make_config(args.quick)
    if cfg.device.type == "cuda":
        from kernels import triton as ops

        print(f"triton kernels on {torch.cuda.get_device_name(0)}, {cfg.dtype}", file=sys.stderr)
    else:
        from kernels import ref as ops

        print(f"no CUDA device: the torch reference (CPU path) on small shapes, {cfg.dtype}, "
              f"{torch.get_num_threads()} threads", file=sys.stderr)
    copy_gbs = copy_bandwidth(cfg)
    rows = [Row(f"device copy {cfg.copy_bytes >> 20} MiB ({cfg.device.type})", "GB/s", copy_gbs)]
    rows += bench_decode(ops, cfg, gen, copy_gbs)
    rows += bench_prefill(ops, cfg, gen, copy_gbs)
    rows += bench_copies(ops, cfg, gen, copy_gbs)
    report("kernels", [r._replace(case=f"[{ops.NAME}] {r.case}") for r in rows], args.json)


if __name__ == "__main__":
    main()
