"""`kvtier serve`: flags, config file, logging, and the run loop (SIGTERM = graceful stop)."""
from __future__ import annotations

import argparse
import asyncio
import errno
import glob
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from kvstore.daemon.config import (DaemonConfig, coerce, default_of, memory_limit, options,
                                   read_token_file, read_toml)
from kvstore.daemon import httpguard
from kvstore import lifetime
from kvstore.errors import ConfigError
from kvstore.tuning import freeze_gc_heap, raise_open_file_limit
from kvstore.wire import netloc

log = logging.getLogger("kvtier.serve")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="config file: a [serve] table with these "
                   "options (underscores, sizes in bytes or '4GiB'), a [quotas] table "
                   "tenant = blocks, and [tenants.NAME] tables (max_namespaces, memory, "
                   "disk); flags override it")
    p.add_argument("--token-file", help="auth tokens, one per line: `TOKEN` (admin) or "
                   "`TOKEN TENANT`; required to bind a non-loopback address")
    for name, flag, meta in options():
        default = default_of(name)
        shown = _shown(default, meta["kind"])
        if meta["kind"] == "flag":
            p.add_argument(flag, dest=name, action="store_false", default=None,
                           help=meta["help"])
        elif isinstance(default, bool):
            p.add_argument(flag, dest=name, action="store_true", default=None,
                           help=meta["help"])
        else:
            kind = meta["kind"]
            typ = str if kind in ("size", "list") or default is None else type(default)
            metavar = {"size": "SIZE", "list": "LIST"}.get(kind) or (
                "SECONDS" if name.endswith("_s") else "N" if typ is int else None)
            p.add_argument(flag, dest=name, type=typ, metavar=metavar, help=meta["help"] + shown)


def _shown(default, kind: str) -> str:
    if default in (None, (), "", -1) or isinstance(default, bool):
        return ""
    if kind == "size":
        unit = next(u for u, b in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10), ("", 0))
                    if default % (1 << b) == 0 and (default or not b))  # (0: "0", not "0TiB")
        shift = {"TiB": 40, "GiB": 30, "MiB": 20, "KiB": 10, "": 0}[unit]
        return f" (default {default >> shift}{unit})"
    if kind == "list":
        return f" (default {','.join(default)})"
    return f" (default {default})"


def build_config(args: argparse.Namespace) -> DaemonConfig:
    kw = read_toml(args.config) if args.config else {}
    token_file = args.token_file or kw.pop("token_file", None)
    for name, _, _ in options():
        value = getattr(args, name, None)
        if value is not None:
            kw[name] = coerce(name, value)
    if kw.get("gpu_bytes", -1) < 0:
        kw["gpu_bytes"] = _default_gpu_bytes()
    if token_file:
        kw["tokens"] = read_token_file(token_file)
    try:
        return DaemonConfig(**kw)
    except TypeError as e:
        raise ConfigError(f"bad configuration: {e}") from e


def _own_threads() -> None:
    """The daemon computes nothing: one OpenMP / torch thread, so no thread pool spins on
    the cores the engines need (its copies are single-threaded memcpy anyway). torch is
    loaded only for a GPU tier (host tiers are numpy): set before it loads, these hold
    for it too."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    from transfer.copy import loaded_torch
    torch = loaded_torch()
    if torch is not None:  # (loaded already: in-process callers of main())
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # already fixed by an earlier parallel op in this process


def _not_dumpable() -> None:
    """No process of our uid but root may read our memory or descriptors (/proc/PID/mem,
    /proc/PID/fd, ptrace): every tenant's KV lives here, and descriptors handed to one
    tenant's clients must not be reachable by another's."""
    import ctypes
    PR_SET_DUMPABLE = 4
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning("could not make the daemon non-dumpable (errno %d): processes of the "
                    "same user can read its memory", ctypes.get_errno())


def _default_gpu_bytes() -> int:
    """1 GiB of GPU tier where a CUDA device is usable, else none. torch (seconds to load)
    is asked only on a host with a GPU driver (NVIDIA's, WSL2's /dev/dxg, ROCm's /dev/kfd);
    without torch (a store-only install) there is no GPU tier."""
    if not (os.path.exists("/proc/driver/nvidia/version") or glob.glob("/dev/nvidia[0-9]*")
            or os.path.exists("/dev/dxg") or os.path.exists("/dev/kfd")):
        return 0
    try:
        import torch
    except ImportError:
        log.info("a GPU driver is present but torch is not installed: no GPU tier "
                 "(pip install 'kvtier[engine]' to have one)")
        return 0
    return (1 << 30) if torch.cuda.is_available() else 0


class _BadRequests(logging.Filter):
    """aiohttp logs each malformed request it answers 400 as an ERROR with its traceback (11
    lines): anyone who can connect could flood the log. Those become one WARNING line per
    10 s, saying how many came between; every other record passes as it is."""

    def __init__(self) -> None:
        super().__init__()
        from kvstore.logevery import LogEvery
        self.every = LogEvery()

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        skipped = self.every.due()
        if skipped is None:
            return False
        record.msg, record.args = "malformed HTTP request answered %d (%s; %d more since " \
            "the last line)", (exc.code, str(exc.message).splitlines()[0][:200], skipped)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True


def check_memory(cfg: DaemonConfig, limit: int | None) -> None:
    """A DRAM tier is one namespace's arena, faulted in when the namespace opens: one bigger
    than the memory this process may use started, and failed every HELLO ('Python int too
    large to convert to C long') or was killed by the OOM killer at the first client."""
    if limit is not None and cfg.dram_bytes > limit:
        raise ConfigError(f"--dram-size {cfg.dram_bytes / 2**30:.1f} GiB is more than the "
                          f"{limit / 2**30:.1f} GiB of memory this host (or its cgroup) "
                          "allows: each namespace's DRAM tier is held in memory; pick a "
                          "smaller --dram-size")


def run(args: argparse.Namespace) -> int:
    lifetime.exit_with_parent()  # started by `kvtier cluster` / `kvtier demo`: end with it
    cfg = build_config(args)
    check_memory(cfg, memory_limit())
    _own_threads()
    from kvstore.tuning import tune_malloc_for_large_blocks
    tune_malloc_for_large_blocks()  # block-sized buffers reuse the heap instead of fresh mmaps
    raise_open_file_limit()
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_BadRequests())
    if not cfg.inspectable:
        _not_dumpable()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass  # the stdlib loop serves the control plane just as correctly
    if lifetime.noted_stop() is not None:
        print("kvtier serve: interrupted while starting", file=sys.stderr, flush=True)
        return 128 + lifetime.noted_stop()
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:  # before its signal handlers were in place (still starting)
        print("kvtier serve: interrupted while starting", file=sys.stderr, flush=True)
        return 130
    except OSError as e:  # a port taken, an address this host does not have
        if isinstance(e, socket.gaierror) or e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL,
                                                          errno.EACCES, errno.EAFNOSUPPORT):
            raise ConfigError(f"cannot listen on {cfg.host} (data port {cfg.port}, control "
                              f"port {cfg.http_port}): {e}; pick another --port / "
                              "--http-port (0: any free one) or --host") from e
        raise
    return 0


async def serve(cfg: DaemonConfig) -> None:
    # SIGINT/SIGTERM are the loop's before the app is set up, and one noted while starting
    # (`lifetime.defer_stop_signals`, the `kvtier serve` command) stops the daemon once it
    # is up: one that came during setup went to asyncio.run's own handler, which cancels the
    # main task, and an await that absorbed the cancellation left the daemon serving, its
    # Ctrl-C lost (a CI run waited 60 s for it)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if lifetime.noted_stop() is not None:
        stop.set()
    from kvstore.daemon.access import DATAPLANE, token_grant
    from kvstore.daemon.app import create_app
    app = create_app(cfg)
    gate = httpguard.Gate(trusted=lambda request: token_grant(request) is not None)
    app.middlewares.append(gate.middleware)
    # (an idle kept-alive connection holds one of httpguard's slots: aiohttp's default
    # keeps it an hour, so 128 requests made and left idle locked the control plane out)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           keepalive_timeout=httpguard.KEEPALIVE_S)
    await runner.setup()
    http = None
    try:
        http = await httpguard.listen(runner.server, cfg.host, cfg.http_port, gate)
        http_port = http.sockets[0].getsockname()[1]
        data_port = app[DATAPLANE].port
        freeze_gc_heap()  # what the start built, and each full pass's survivors after it
        auth = "token required" if cfg.auth_required else "no auth (loopback only)"
        data, control = netloc(cfg.host, data_port), netloc(cfg.host, http_port)
        print(f"kvtier serve: data plane kvtier://{data}  control "
              f"http://{control}  data dir {cfg.data_dir}  ({auth})\n"
              f"  connect: kvstore.Client('kvtier://{data}', namespace=...)"
              f"  (same host: shared memory over the local socket, found automatically"
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
        if http is not None:
            http.close()  # no new connection; runner.cleanup ends the open ones
        await runner.cleanup()
    print("kvtier serve: stopped", flush=True)


async def _join_cluster(app: web.Application, cfg: DaemonConfig, data_port: int, http_port: int):
    if not cfg.cluster:
        return None
    from kvstore.daemon.access import REGISTRY
    from kvstore.daemon.cluster import SLOT, ClusterAgent
    agent = ClusterAgent(cfg, app[REGISTRY], data_port, http_port)
    await agent.start()
    app[SLOT].agent = agent
    print(f"kvtier serve: joined cluster {cfg.cluster} as {cfg.node_id} "
          f"(leader: {agent.member.leader_id})", flush=True)
    return agent
