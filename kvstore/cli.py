"""`kvtier`: the command line. Each subcommand is a (configure parser, run) pair.

    kvtier hash --model NAME ... 1 2 3 ...   block hashes of a token sequence
    kvtier fsck DIR [--repair]               verify every block of an SSD tier directory
    kvtier bench NAME [ARGS...]              run a benchmark from a source checkout's bench/
    kvtier serve [--dram-size 4GiB ...]      run a store daemon (see `kvtier serve --help`)
    kvtier stats [--url http://HOST:7480]    a running daemon's figures
    kvtier cluster [--prefill N --decode M | --colocated K]   store + workers + OpenAI API
    kvtier demo                              no pool vs pool vs prefill/decode + pool, one run
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Callable

from kvstore.errors import KVStoreError

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
BENCHES = {"store": "store_tiers.py", "transfer": "transfer.py", "kernels": "kernels.py",
           "sched": "sched_trace.py"}


def _hash_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("tokens", nargs="+", type=int, help="token ids")
    p.add_argument("--model", required=True, help="model name (part of the namespace)")
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--num-kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--revision", default="main")
    p.add_argument("--tenant", default="", help="tenant salt: the same prefix in two tenants "
                   "never shares a block")


def _hash_run(args: argparse.Namespace) -> int:
    from kvstore.keys import Namespace, hash_blocks
    ns = Namespace(args.model, args.num_layers, args.num_kv_heads, args.head_dim, args.dtype,
                   args.block_tokens, args.revision, args.tenant)
    print(f"namespace {ns.ns_id:#018x}  block {ns.block_bytes} bytes  shape {ns.block_shape}")
    for i, h in enumerate(hash_blocks(ns, args.tokens)):
        print(f"block {i}: {h.hex()}")
    return 0


def _fsck_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="an SSD tier directory (RocksDB)")
    p.add_argument("--repair", action="store_true", help="delete blocks that fail verification")


def _fsck_run(args: argparse.Namespace) -> int:
    from kvstore.fsck import fsck
    report = fsck(args.path, repair=args.repair)
    print(f"{report.num_ok} blocks ok, {len(report.bad)} bad, {report.num_bytes / 2**20:.1f} MiB")
    for key, reason in report.bad[:20]:
        print(f"  {key.hex()}: {reason}")
    if report.bad and not args.repair:
        print("run again with --repair to delete the bad blocks (they would be served as misses)")
    return 1 if report.bad and not args.repair else 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="arguments for the benchmark (try: kvtier bench store --help)")


def _bench_run(args: argparse.Namespace) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "bench", BENCHES[args.name])
    if not os.path.exists(script):
        print(f"kvtier bench needs a source checkout: {script} is missing. Clone the repository "
              "and run `make demo` or `python bench/...` there.", file=sys.stderr)
        return 2
    sys.argv = [script, *args.bench_args]
    runpy.run_path(script, run_name="__main__")
    return 0


def _serve_args(p: argparse.ArgumentParser) -> None:
    from kvstore.daemon.serve import configure
    configure(p)


def _serve_run(args: argparse.Namespace) -> int:
    from kvstore.daemon.serve import run
    return run(args)


def _stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:7480", help="the daemon's control plane")
    p.add_argument("--token", default=None, help="auth token (default $KVTIER_TOKEN)")


def _stats_run(args: argparse.Namespace) -> int:
    from kvstore.client.http import print_stats
    return print_stats(args.url, args.token or os.environ.get("KVTIER_TOKEN", ""))


def _cluster_args(p: argparse.ArgumentParser) -> None:
    from engine_adapter.serving.launcher import configure
    configure(p)


def _cluster_run(args: argparse.Namespace) -> int:
    from engine_adapter.serving.launcher import run
    return run(args)


def _demo_args(p: argparse.ArgumentParser) -> None:
    from engine_adapter.serving.demo import configure
    configure(p)


def _demo_run(args: argparse.Namespace) -> int:
    from engine_adapter.serving.demo import run
    return run(args)


COMMANDS: list[Command] = [
    ("hash", "print the block hashes of a token sequence", _hash_args, _hash_run),
    ("fsck", "verify (and repair) the blocks of an SSD tier directory", _fsck_args, _fsck_run),
    ("bench", "run a benchmark (store, transfer, kernels, sched) and print its figures",
     _bench_args, _bench_run),
    ("serve", "run a store daemon node (DRAM + SSD tiers; GPU where present)", _serve_args,
     _serve_run),
    ("stats", "print a running daemon's per-namespace, per-tier figures", _stats_args,
     _stats_run),
    ("cluster", "run a store node, prefill/decode workers and an OpenAI-compatible API on "
     "this host", _cluster_args, _cluster_run),
    ("demo", "replay long multi-turn conversations on the same workers without a pool, "
     "sharing a pool, and split into prefill/decode over the pool; print each figure with "
     "its ratio to the no-pool baseline and write a TTFT chart", _demo_args, _demo_run),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="kvtier: a disaggregated KV-cache store for LLM serving "
        "(GPU / DRAM / SSD tiers, NIXL-like transfers, cache-aware scheduling).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text, configure, run in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KVStoreError as e:
        print(f"kvtier {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
