"""`kvtier`: the command line. Each subcommand is a (configure parser, run) pair; only the
chosen command's parser is built (its module imported), so `kvtier hash` loads no server.

    kvtier hash --model NAME ... 1 2 3 ...   block hashes of a token sequence
    kvtier fsck DIR [--repair]               verify every block of an SSD tier directory
    kvtier bench NAME [ARGS...]              run a benchmark of the bench package
    kvtier serve [--dram-size 4GiB ...]      run a store daemon (see `kvtier serve --help`)
    kvtier stats [--url http://HOST:7480]    a running daemon's figures
    kvtier cluster [--prefill N --decode M | --colocated K]   store + workers + OpenAI API
    kvtier demo                              no pool vs pool vs prefill/decode + pool, one run
"""
from __future__ import annotations

import argparse
import contextlib
import runpy
import sys
from typing import Callable

from kvstore.errors import KVStoreError
from kvstore.lifetime import Terminated, defer_stop_signals, on_sigterm

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
BENCHES = {"store": "store_tiers", "service": "store_service", "transfer": "transfer_backends",
           "kernels": "paged_kernels", "sched": "sched_trace", "ttft": "ttft",
           "plugins": "plugins", "cluster": "cluster"}


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
    try:
        ns = Namespace(args.model, args.num_layers, args.num_kv_heads, args.head_dim,
                       args.dtype, args.block_tokens, args.revision, args.tenant)
        hashes = hash_blocks(ns, args.tokens)
    except ValueError as e:  # a dimension out of range, an unknown dtype, a token id past
        print(f"kvtier hash: {e}", file=sys.stderr)  # int32: said, no traceback
        return 2
    print(f"namespace {ns.ns_id:#018x}  block {ns.block_bytes} bytes  shape {ns.block_shape}")
    for i, h in enumerate(hashes):
        print(f"block {i}: {h.hex()}")
    return 0


def _fsck_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="an SSD tier directory (the daemon's DATA_DIR/<ns_id>/ssd)")
    p.add_argument("--repair", action="store_true", help="drop the blocks that fail "
                   "verification and rebuild a damaged index from the slab file")


def _fsck_run(args: argparse.Namespace) -> int:
    """Exit 0 when every block verifies (or --repair fixed what did not), 1 otherwise."""
    from kvstore.fsck import fsck
    report = fsck(args.path, repair=args.repair)
    print(f"{report.num_ok} blocks ok, {len(report.bad)} bad, "
          f"{report.num_bytes / 2**20:.1f} MiB")
    if report.index_error:
        print(f"  {report.index_error}; {report.num_recoverable} intact blocks in the slab "
              "file are not listed")
    elif report.num_recoverable:
        print(f"  and {report.num_recoverable} intact blocks the index does not list yet "
              "(their entries were queued when the tier stopped without closing): the "
              "tier adopts them at its next open")
    for key, reason in report.bad:
        print(f"  {key.hex()}: {reason}")
    if report.clean:
        return 0
    if args.repair:
        print("repaired: bad blocks dropped" + (", index rebuilt from the slab file"
                                                if report.index_error else ""))
        return 0
    print("run again with --repair to drop the bad blocks (a running daemon serves them as "
          "misses)" + (" and rebuild the index" if report.index_error else ""))
    return 1


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="arguments for the benchmark (try: kvtier bench store --help)")


def _bench_run(args: argparse.Namespace) -> int:
    sys.argv = [f"kvtier bench {args.name}", *args.bench_args]
    runpy.run_module(f"bench.{BENCHES[args.name]}", run_name="__main__", alter_sys=True)
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
    from kvstore import env
    return print_stats(args.url, args.token or env.token())


def _cluster_args(p: argparse.ArgumentParser) -> None:
    from engine_adapter.serving.launcher import configure
    configure(p)


def _cluster_run(args: argparse.Namespace) -> int:
    from engine_adapter.serving.launcher import run
    return run(args)


def _demo_args(p: argparse.ArgumentParser) -> None:
    from kvtier.demo import configure
    configure(p)


def _demo_run(args: argparse.Namespace) -> int:
    from kvtier.demo import run
    return run(args)


COMMANDS: list[Command] = [
    ("hash", "print the block hashes of a token sequence", _hash_args, _hash_run),
    ("fsck", "verify (and repair) the blocks of an SSD tier directory", _fsck_args, _fsck_run),
    ("bench", "run a benchmark (" + ", ".join(BENCHES) + ") and print its figures",
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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command listed; only `command`'s own options configured (its imports done)."""
    parser = argparse.ArgumentParser(
        prog="kvtier", description="kvtier: a disaggregated KV-cache store for LLM serving "
        "(GPU / DRAM / SSD tiers, NIXL-like transfers, cache-aware scheduling).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text, configure, run in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if name == command:
            configure(p)
        p.set_defaults(run=run)
    return parser


# what a store-only install (`pip install kvtier`) leaves out, and the extra that adds it
EXTRAS = {"torch": "engine", "transformers": "hf", "gguf": "hf", "accelerate": "hf",
          "safetensors": "hf"}


def _missing(command: str | None, e: ModuleNotFoundError) -> int:
    """A command that needs what the install left out: which package, and the pip line that
    adds it (the engine's commands had died in a traceback from deep in an import)."""
    top = (e.name or "").partition(".")[0]
    extra = "hf" if command in ("cluster", "demo") else EXTRAS.get(top)
    if extra is None:
        raise e
    print(f"kvtier {command}: needs {top}, which a store-only install (pip install kvtier) "
          f"leaves out: pip install 'kvtier[{extra}]'", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = {c[0] for c in COMMANDS}
    command = next((a for a in argv if not a.startswith("-")), None)
    daemon = command == "serve"
    if daemon:  # (before its imports: see defer_stop_signals)
        defer_stop_signals()
    try:
        args = build_parser(command if command in names else None).parse_args(argv)
    except ModuleNotFoundError as e:
        return _missing(command, e)
    try:
        # (commands that serve set their own handler over it)
        with contextlib.nullcontext() if daemon else on_sigterm():
            return args.run(args)
    except ModuleNotFoundError as e:
        return _missing(args.command, e)
    except KVStoreError as e:
        print(f"kvtier {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command took SIGINT over (still starting)
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"kvtier {args.command}: terminated", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
