"""`kvtier cluster`: a store node, worker processes and the front end, on one host.

    kvtier cluster                         # 1 prefill + 1 decode worker over a pool, :8000
    kvtier cluster --prefill 2 --decode 2
    kvtier cluster --colocated 2 --pool    # 2 workers doing both, sharing the pool
    kvtier cluster --colocated 2           # the baseline: 2 workers, no shared pool

Every process owns its CPU threads (`cpu_plan`): the workers split the cores, one torch /
OpenMP thread pool each (never more threads than cores between them); the store node and
the front end run with one thread each, since they only move bytes and messages. The store
node (`DaemonProcess`) and the workers (`serving.ports`) listen on loopback ports the kernel
picks, so nothing else can take one between choosing and binding it. Ctrl-C
(or SIGTERM) stops the front end, then every worker and the store node.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator, NamedTuple, TextIO

from engine_adapter.serving.ports import bind, wait_port_file
from engine_adapter.serving.protocol import Role
from engine_adapter.serving.router import POOL_NODE, Router, WorkerHandle
from kvstore import lifetime
from kvstore.config import parse_size
from kvstore.daemon.process import DaemonProcess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class ClusterConfig:
    prefill: int = 1
    decode: int = 1
    colocated: int = 0               # > 0: K workers doing prefill and decode
    pool: bool = True                # colocated workers share the pool (always with P/D)
    host: str = "127.0.0.1"
    port: int = 8000
    num_blocks: int = 512            # each worker's paged KV cache, in blocks
    max_num_seqs: int = 16           # requests each worker runs at once
    chunk_tokens: int = 256          # prefill chunk: blocks reach the pool chunk by chunk
    dram_size: str = "2GiB"          # the pool's DRAM tier
    ssd_size: str = "0"              # the pool's SSD tier (0 = none)
    data_dir: str | None = None      # default: a temporary directory
    threads: int = 0                 # torch threads per worker; 0 = cores / workers
    policy: str = "conductor"
    quiet_workers: bool = False      # send worker output to a log file instead of stderr
    worker_timeout_s: float = 15.0   # a worker silent this long is out of service

    def __post_init__(self) -> None:
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("worker counts must be >= 0")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError("a prefill/decode cluster needs --prefill >= 1 and --decode >= 1 "
                             "(or use --colocated K)")
        if self.chunk_tokens < 16:
            raise ValueError("--chunk-tokens must be >= 16 (one block)")
        # (each of these started the store and the workers, then failed with a traceback)
        if self.num_blocks < 2:
            raise ValueError("--num-blocks must be >= 2: a worker's cache holds at least "
                             "two 16-token blocks")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.threads < 0:
            raise ValueError("--threads must be >= 0 (0: the cores shared out)")
        if not 1 <= self.worker_timeout_s < 1e6:  # (NaN too)
            raise ValueError(f"--worker-timeout must be 1 to 1e6 seconds, not "
                             f"{self.worker_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a port (0-65535; 0: any free one)")
        for flag, size in (("--dram-size", self.dram_size), ("--ssd-size", self.ssd_size)):
            try:
                parse_size(size)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
        if self.data_dir and os.path.exists(self.data_dir) and not os.path.isdir(self.data_dir):
            raise ValueError(f"--data-dir {self.data_dir} exists and is not a directory")

    @property
    def pooled(self) -> bool:
        return self.pool or not self.colocated

    @property
    def roles(self) -> list[tuple[str, Role]]:
        if self.colocated:
            return [(f"worker-{i}", Role.COLOCATED) for i in range(self.colocated)]
        return ([(f"prefill-{i}", Role.PREFILL) for i in range(self.prefill)]
                + [(f"decode-{i}", Role.DECODE) for i in range(self.decode)])

    @property
    def describe(self) -> str:
        if self.colocated:
            return f"{self.colocated} colocated, {'shared pool' if self.pool else 'no pool'}"
        return f"{self.prefill} prefill + {self.decode} decode, shared pool"


class CpuPlan(NamedTuple):
    cores: int
    worker_threads: int

    def describe(self, cfg: ClusterConfig) -> str:
        n = len(cfg.roles)
        over = n * self.worker_threads > self.cores
        return (f"cpu plan ({self.cores} cores): {n} workers x {self.worker_threads} torch "
                f"thread{'s' if self.worker_threads > 1 else ''}"
                + (", store node 1 thread" if cfg.pooled else "")
                + ", front end 1 thread (event loops and memcpy, mostly idle)"
                + (f"; WARNING: {n * self.worker_threads} worker threads on {self.cores} "
                   "cores: they will slow each other down" if over else ""))


def cpu_plan(cfg: ClusterConfig) -> CpuPlan:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return CpuPlan(cores or 1, cfg.threads or max(1, (cores or 1) // len(cfg.roles)))


def own_threads(n: int) -> None:
    """Pin this process's torch and OpenMP pools to `n` threads (and its children's)."""
    for var in THREAD_VARS:
        os.environ[var] = str(n)
    if "torch" in sys.modules:
        import torch
        torch.set_num_threads(n)


def child_env(threads: int) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
            **{var: str(threads) for var in THREAD_VARS}, **lifetime.child_env()}


def store_node(cfg: ClusterConfig, data_dir: str, log: TextIO) -> DaemonProcess:
    """The store node (`kvtier serve`, with the router's event route), not started: entering
    it starts it on loopback ports the kernel picks and returns once it is healthy."""
    return DaemonProcess(data_dir, "--node-id", POOL_NODE, dram_size=cfg.dram_size,
                         ssd_size=cfg.ssd_size, env=child_env(1), cwd=ROOT, echo=log)


def spawn_worker(cfg: ClusterConfig, name: str, role: Role, store_url: str | None,
                 threads: int, port_file: str, log: TextIO | None) -> subprocess.Popen:
    """A worker process on a port the kernel picks, which it writes to `port_file`."""
    cmd = [sys.executable, "-m", "engine_adapter.serving.worker", "--name", name, "--role",
           role.value, "--port", "0", "--port-file", port_file, "--num-blocks",
           str(cfg.num_blocks), "--max-num-seqs", str(cfg.max_num_seqs), "--chunk-tokens",
           str(cfg.chunk_tokens), "--threads", str(threads)]
    if store_url:
        cmd += ["--store", store_url]
    with contextlib.suppress(FileNotFoundError):
        os.remove(port_file)  # a previous run's, in a reused --data-dir
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=child_env(threads))


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
def worker_processes(cfg: ClusterConfig, store_url: str | None, run_dir: str,
                     log: TextIO | None) -> Iterator[list[WorkerHandle]]:
    """Start every worker at once (their start-ups overlap), then learn each one's port;
    stops them all on exit."""
    threads = cpu_plan(cfg).worker_threads
    started: list[tuple[str, Role, subprocess.Popen, str]] = []
    try:
        for name, role in cfg.roles:
            port_file = os.path.join(run_dir, f"{name}.port")
            proc = spawn_worker(cfg, name, role, store_url, threads, port_file, log)
            started.append((name, role, proc, port_file))
        yield [WorkerHandle(name, role, f"http://127.0.0.1:{wait_port_file(f, p, name)}", p)
               for name, role, p, f in started]
    finally:
        with lifetime.teardown():  # (a SIGTERM meanwhile cuts no stop short)
            for _, _, proc, _ in reversed(started):
                stop_process(proc)


@contextlib.contextmanager
def cluster_processes(cfg: ClusterConfig) -> Iterator[Router]:
    """Start the store (when pooled) and the workers; yields a Router over them (not yet
    started: the front end's startup waits for the workers). Stops them all on exit, the
    workers first (they flush to the store)."""
    from kvstore.scheduler import PolicyKind

    with contextlib.ExitStack() as stack:
        tmp = cfg.data_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvtier-cluster-"))
        os.makedirs(tmp, exist_ok=True)  # a new --data-dir: the workers' port files go there
        log = (stack.enter_context(open(os.path.join(tmp, "workers.log"), "a"))
               if cfg.quiet_workers else None)
        own_threads(1)  # the front end: an event loop, hashing and JSON
        store = (stack.enter_context(store_node(cfg, os.path.join(tmp, "store"),
                                                log or sys.stdout))
                 if cfg.pooled else None)
        # convert the model once here, not in every worker at once
        from engine_adapter.serving.model_cache import ensure_cached
        ensure_cached()
        workers = stack.enter_context(
            worker_processes(cfg, store.url if store else None, tmp, log))
        yield Router(workers, PolicyKind(cfg.policy), pooled=cfg.pooled,
                     store_control_url=store.http if store else None,
                     worker_timeout_s=cfg.worker_timeout_s)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--colocated", type=int, default=0, metavar="K",
                   help="K workers doing prefill and decode instead (no pool unless --pool)")
    p.add_argument("--pool", action="store_true",
                   help="with --colocated: the workers share a pool (a store node)")
    p.add_argument("--host", default="127.0.0.1", help="front end bind address")
    p.add_argument("--port", type=int, default=8000,
                   help="front end port (default 8000; 0: one the kernel picks, printed)")
    p.add_argument("--num-blocks", type=int, default=512,
                   help="each worker's paged KV cache in 16-token blocks (default 512)")
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="requests each worker runs at once (default 16)")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help="prefill chunk in tokens: a request computes at most this many per step "
                   "(decodes and short prefills share the step), and each chunk's blocks go to "
                   "the pool while the next one computes (default 256)")
    p.add_argument("--dram-size", default="2GiB", help="the pool's DRAM tier (default 2GiB)")
    p.add_argument("--ssd-size", default="0", help="the pool's SSD tier (default 0 = none)")
    p.add_argument("--data-dir", help="store data and logs (default: a temporary directory)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (default: cores / workers, at least 1)")
    p.add_argument("--policy", default="conductor",
                   choices=["conductor", "prefix", "least_loaded", "round_robin", "random"])
    p.add_argument("--worker-timeout", type=float, default=15.0, metavar="S",
                   help="a worker that answers no health check for S seconds (stopped, hung) "
                   "is taken out of service, its requests ending with an error; it comes "
                   "back once it answers again (default 15)")


def config_from_args(a: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(a.prefill, a.decode, a.colocated, a.pool or not a.colocated, a.host,
                         a.port, a.num_blocks, a.max_num_seqs, a.chunk_tokens, a.dram_size,
                         a.ssd_size, a.data_dir, a.threads, a.policy,
                         worker_timeout_s=a.worker_timeout)


def run(a: argparse.Namespace) -> int:
    import logging

    from engine_adapter.serving.frontend import FrontendConfig, create_app, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        print(f"kvtier cluster: {e}", file=sys.stderr)
        return 2
    try:
        sock = bind(cfg.host, cfg.port)  # now: a taken port fails before the workers load
    except OSError as e:
        print(f"kvtier cluster: cannot listen on {cfg.host}:{cfg.port}: {e.strerror}",
              file=sys.stderr)
        return 2
    api = f"http://{cfg.host}:{sock.getsockname()[1]}"
    with sock, contextlib.ExitStack() as stack:
        try:
            router = stack.enter_context(cluster_processes(cfg))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - a start that failed: said, not a traceback
            print(f"kvtier cluster: could not start: {e}", file=sys.stderr)
            return 1
        names = ", ".join(n for n, _ in cfg.roles)
        print(f"kvtier cluster: starting {names} ({cfg.describe}); {cpu_plan(cfg).describe(cfg)}"
              f"\nthe API opens at {api} once every worker has loaded its model and measured "
              "its speed", flush=True)

        def announce() -> None:
            print(f"kvtier cluster ready: {api}/v1 ({cfg.describe}, policy {cfg.policy}; "
                  f"{router.cost_summary()})", flush=True)

        serve(create_app(FrontendConfig(), router), sock, ready=announce)
    print("kvtier cluster: stopped", flush=True)
    return 0
