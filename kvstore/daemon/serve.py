"""`kvtier serve`: flags, config file, logging, and the run loop (SIGTERM = graceful stop)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from aiohttp import web

from kvstore.config import parse_size
from kvstore.daemon.config import DaemonConfig, read_token_file, read_toml
from kvstore.errors import ConfigError

log = logging.getLogger("kvtier.serve")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="config file: a [serve] table with these "
                   "options (underscores, sizes in bytes or '4GiB') and a [quotas] table "
                   "tenant = blocks; flags override it")
    p.add_argument("--host", help="bind address (default 127.0.0.1; others need a token)")
    p.add_argument("--port", type=int, help="data-plane port (default 7481; 0 = any)")
    p.add_argument("--http-port", type=int, help="control-plane port (default 7480; 0 = any)")
    p.add_argument("--data-dir", help="SSD tier directory (default ./kvtier-data)")
    p.add_argument("--dram-size", help="DRAM tier size per namespace (default 1GiB; 0 = none)")
    p.add_argument("--ssd-size", help="SSD tier size per namespace (default 64GiB; 0 = none)")
    p.add_argument("--gpu-size", help="GPU tier size per namespace (default 1GiB when CUDA "
                   "is available, else none)")
    p.add_argument("--high-watermark", type=float, help="background eviction starts above "
                   "this fill fraction (default 0.95)")
    p.add_argument("--low-watermark", type=float, help="...and stops at this one (default 0.85)")
    p.add_argument("--block-tokens", type=int, help="accept only namespaces with this block "
                   "size in tokens (default: any)")
    p.add_argument("--quota-blocks", type=int, help="most blocks a namespace keeps in each "
                   "tier (default: no cap beyond the tier sizes)")
    p.add_argument("--max-namespaces", type=int, help="namespaces hosted at once (default 8)")
    p.add_argument("--token-file", help="auth tokens, one per line: `TOKEN` (admin) or "
                   "`TOKEN TENANT`; required to bind a non-loopback address")
    p.add_argument("--reservation-timeout", type=float, dest="reservation_timeout_s",
                   help="seconds before an uncommitted put is reclaimed (default 30)")
    p.add_argument("--no-wal", dest="durable", action="store_false", default=None,
                   help="SSD puts without the write-ahead log (faster; recent blocks lost on "
                   "a crash, never corrupted)")
    p.add_argument("--agent-backends", metavar="LIST", help="transfer backends each "
                   "namespace's DRAM arena is exported through for clients that move bytes "
                   "with a transfer Agent (Client(use_agent=True)): comma-separated of tcp, "
                   "nixl, ucx; 'none' to export nothing (default tcp)")
    p.add_argument("--node-id", help="this node's name in KV events (default the hostname)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--cluster", metavar="etcd://HOST:PORT[,HOST:PORT]/PREFIX",
                   help="join a multi-node pool coordinated by etcd (the node registers with a "
                   "lease, ships its KV events to the elected leader, and serves its blocks)")
    p.add_argument("--advertise", metavar="ADDR", help="address peers and clients use to reach "
                   "this node (default: the bind address)")
    p.add_argument("--cluster-ttl", type=int, dest="cluster_ttl_s", help="seconds of silence "
                   "after which etcd drops a node (default 5)")


def build_config(args: argparse.Namespace) -> DaemonConfig:
    kw = read_toml(args.config) if args.config else {}
    token_file = args.token_file or kw.pop("token_file", None)
    for flag in ("host", "port", "http_port", "data_dir", "high_watermark", "low_watermark",
                 "block_tokens", "quota_blocks", "max_namespaces", "reservation_timeout_s",
                 "durable", "node_id", "log_level", "cluster", "advertise", "cluster_ttl_s"):
        if getattr(args, flag) is not None:
            kw[flag] = getattr(args, flag)
    if args.agent_backends is not None:
        kw["agent_backends"] = args.agent_backends
    if isinstance(kw.get("agent_backends"), str):
        raw = kw["agent_backends"]
        kw["agent_backends"] = () if raw in ("", "none") else tuple(raw.split(","))
    for flag, key in (("dram_size", "dram_bytes"), ("ssd_size", "ssd_bytes"),
                      ("gpu_size", "gpu_bytes")):
        if getattr(args, flag) is not None:
            kw[key] = getattr(args, flag)
    for key in ("dram_bytes", "ssd_bytes", "gpu_bytes", "max_payload_bytes"):
        if key in kw:
            kw[key] = parse_size(kw[key])
    if "gpu_bytes" not in kw:
        kw["gpu_bytes"] = _default_gpu_bytes()
    if token_file:
        kw["tokens"] = read_token_file(token_file)
    try:
        return DaemonConfig(**kw)
    except TypeError as e:
        raise ConfigError(f"bad configuration: {e}") from e


def _default_gpu_bytes() -> int:
    import torch
    return (1 << 30) if torch.cuda.is_available() else 0


def run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    from kvstore.tuning import tune_malloc_for_large_blocks
    tune_malloc_for_large_blocks()  # block-sized buffers reuse the heap instead of fresh mmaps
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass  # the stdlib loop serves the control plane just as correctly
    asyncio.run(serve(cfg))
    return 0


async def serve(cfg: DaemonConfig) -> None:
    from kvstore.daemon.app import DATAPLANE, create_app
    app = create_app(cfg)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, cfg.host, cfg.http_port)
        await site.start()
        http_port = site._server.sockets[0].getsockname()[1]
        data_port = app[DATAPLANE].port
        auth = "token required" if cfg.auth_required else "no auth (loopback only)"
        print(f"kvtier serve: data plane kvtier://{cfg.host}:{data_port}  control "
              f"http://{cfg.host}:{http_port}  data dir {cfg.data_dir}  ({auth})\n"
              f"  connect: kvstore.Client('kvtier://{cfg.host}:{data_port}', namespace=...)"
              f"  (same host: shared memory, found automatically"
              + (f"; other hosts: inline TCP, or use_agent=True for transfer-agent "
                 f"{'/'.join(cfg.agent_backends)}" if cfg.agent_backends else
                 "; other hosts: inline TCP") + ")",
              flush=True)
        agent = await _join_cluster(app, cfg, data_port, http_port)
        await stop.wait()
        log.info("stopping: finishing in-flight ops, flushing memory tiers to SSD")
        if agent is not None:
            await agent.stop()  # leave the pool first: peers stop sending work here
    finally:
        await runner.cleanup()
    print("kvtier serve: stopped", flush=True)


async def _join_cluster(app: web.Application, cfg: DaemonConfig, data_port: int, http_port: int):
    if not cfg.cluster:
        return None
    from kvstore.daemon.app import REGISTRY
    from kvstore.daemon.cluster import SLOT, ClusterAgent
    agent = ClusterAgent(cfg, app[REGISTRY], data_port, http_port)
    await agent.start()
    app[SLOT].agent = agent
    print(f"kvtier serve: joined cluster {cfg.cluster} as {cfg.node_id} "
          f"(leader: {agent.member.leader_id})", flush=True)
    return agent
