"""`kvtier cluster`: a store node, worker processes and the front end, on one host.

    kvtier cluster                         # 1 prefill + 1 decode worker over a pool, :8000
    kvtier cluster --prefill 2 --decode 2
    kvtier cluster --colocated 2           # the baseline: 2 workers, no shared pool

Ctrl-C (or SIGTERM) stops the front end, then every worker and the store node.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Iterator

from engine_adapter.serving.protocol import Role
from engine_adapter.serving.router import Router, WorkerHandle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class ClusterConfig:
    prefill: int = 1
    decode: int = 1
    colocated: int = 0               # > 0: the baseline, K workers and no pool
    host: str = "127.0.0.1"
    port: int = 8000
    num_blocks: int = 512            # each worker's paged KV cache, in blocks
    dram_size: str = "2GiB"          # the pool's DRAM tier
    ssd_size: str = "0"              # the pool's SSD tier (0 = none)
    data_dir: str | None = None      # default: a temporary directory
    threads: int = 0                 # torch threads per worker; 0 = cores / workers
    policy: str = "conductor"
    quiet_workers: bool = False      # send worker output to a log file instead of stderr

    def __post_init__(self) -> None:
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("worker counts must be >= 0")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError("a pooled cluster needs --prefill >= 1 and --decode >= 1 "
                             "(or use --colocated K for the baseline)")

    @property
    def roles(self) -> list[tuple[str, Role]]:
        if self.colocated:
            return [(f"worker-{i}", Role.COLOCATED) for i in range(self.colocated)]
        return ([(f"prefill-{i}", Role.PREFILL) for i in range(self.prefill)]
                + [(f"decode-{i}", Role.DECODE) for i in range(self.decode)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Store:
    """A `kvtier serve` child process on free loopback ports."""

    def __init__(self, cfg: ClusterConfig, data_dir: str, log) -> None:
        self.port, self.http_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "kvstore.daemon", "--port", str(self.port),
               "--http-port", str(self.http_port), "--data-dir", data_dir, "--dram-size",
               cfg.dram_size, "--ssd-size", cfg.ssd_size, "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"kvtier://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the store node (kvtier serve) exited with code "
                                   f"{self.proc.returncode}; see its output above")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz", timeout=2)
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"the store node did not become healthy in {timeout_s:.0f} s")


def spawn_worker(cfg: ClusterConfig, name: str, role: Role, store_url: str | None,
                 threads: int, log) -> WorkerHandle:
    port = free_port()
    cmd = [sys.executable, "-m", "engine_adapter.serving.worker", "--name", name, "--role",
           role.value, "--port", str(port), "--num-blocks", str(cfg.num_blocks),
           "--threads", str(threads)]
    if store_url:
        cmd += ["--store", store_url]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    return WorkerHandle(name, role, f"http://127.0.0.1:{port}", proc)


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def cluster_processes(cfg: ClusterConfig) -> Iterator[Router]:
    """Start the store (pool mode) and the workers; yields a Router over them (not yet
    started: the front end's startup waits for the workers). Stops them all on exit."""
    from kvstore.scheduler import PolicyKind

    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        tmp = cfg.data_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvtier-cluster-"))
        log = (stack.enter_context(open(os.path.join(tmp, "workers.log"), "ab"))
               if cfg.quiet_workers else None)
        try:
            store = None
            if not cfg.colocated:
                store = Store(cfg, os.path.join(tmp, "store"), log)
                procs.append(store.proc)
                store.wait_healthy()
            # convert the model once here, not in every worker at once
            from engine_adapter.serving.model_cache import ensure_cached
            ensure_cached()
            roles = cfg.roles
            threads = cfg.threads or max(1, (os.cpu_count() or 1) // len(roles))
            workers = []
            for name, role in roles:
                workers.append(spawn_worker(cfg, name, role, store.url if store else None,
                                            threads, log))
                procs.append(workers[-1].proc)
            yield Router(workers, PolicyKind(cfg.policy), pooled=not cfg.colocated)
        finally:
            for p in reversed(procs):  # workers first (they flush to the store), then the store
                stop_process(p)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--colocated", type=int, default=0, metavar="K",
                   help="the baseline: K workers doing prefill and decode, no shared pool")
    p.add_argument("--host", default="127.0.0.1", help="front end bind address")
    p.add_argument("--port", type=int, default=8000, help="front end port (default 8000)")
    p.add_argument("--num-blocks", type=int, default=512,
                   help="each worker's paged KV cache in 16-token blocks (default 512)")
    p.add_argument("--dram-size", default="2GiB", help="the pool's DRAM tier (default 2GiB)")
    p.add_argument("--ssd-size", default="0", help="the pool's SSD tier (default 0 = none)")
    p.add_argument("--data-dir", help="store data and logs (default: a temporary directory)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (default: cores / workers)")
    p.add_argument("--policy", default="conductor",
                   choices=["conductor", "prefix", "least_loaded", "round_robin", "random"])


def config_from_args(a: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(a.prefill, a.decode, a.colocated, a.host, a.port, a.num_blocks,
                         a.dram_size, a.ssd_size, a.data_dir, a.threads, a.policy)


def run(a: argparse.Namespace) -> int:
    import logging

    from aiohttp import web

    from engine_adapter.serving.frontend import FrontendConfig, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        print(f"kvtier cluster: {e}", file=sys.stderr)
        return 2
    with cluster_processes(cfg) as router:
        names = ", ".join(n for n, _ in cfg.roles)
        print(f"kvtier cluster: starting {names}; the API opens at http://{cfg.host}:{cfg.port} "
              "once every worker has loaded its model", flush=True)

        async def announce(app: web.Application) -> None:
            print(f"kvtier cluster ready: http://{cfg.host}:{cfg.port}/v1 "
                  f"({'colocated baseline' if cfg.colocated else 'pooled'}, policy {cfg.policy})",
                  flush=True)

        app = create_app(FrontendConfig(), router)
        app.on_startup.append(announce)
        web.run_app(app, host=cfg.host, port=cfg.port, print=None, access_log=None)
    print("kvtier cluster: stopped", flush=True)
    return 0
