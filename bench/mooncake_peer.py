"""Mooncake Store as a measured baseline for bench/store_service.py.

Mooncake's master, HTTP metadata server and transfer engine bind every interface whatever
address they are given, so nothing of it runs in the host network namespace: the parent
(any venv, stdlib only) starts `unshare -n` with loopback alone, and in there a worker
running under build/venv-mooncake starts `mooncake_master`, a storage client process that
contributes the global segment, and then measures as a client contributing none. The
worker prints one JSON line; the parent parses it.

Put: `batch_put_from` of `batch` fresh keys from a registered buffer (zero copy), the keys
removed again outside the timed call so the segment stays bounded. Get: `batch_get_into`
of one stored set into a registered, preallocated buffer. Protocol "tcp".

    python bench/mooncake_peer.py [--quick | --selftest] [--json PATH]   # prints figures
    make bench-deps-mooncake                                            # the venv
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import NamedTuple

KiB, MiB = 1 << 10, 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PYTHON = os.path.join(ROOT, "build", "venv-mooncake", "bin", "python")
PACKAGE = "mooncake-transfer-engine-non-cuda"
INSTALL = "make bench-deps-mooncake (a python3.11 venv at build/venv-mooncake with " \
          f"{PACKAGE}==0.3.13.post1 and numpy==2.4.6; apt libibverbs1 libnl-3-200 " \
          "libnl-route-3-200)"
API = "batch_put_from of fresh keys (their batch_remove untimed) / batch_get_into, both on " \
      "registered buffers, tcp"
MASTER_PORT, METADATA_PORT, METRICS_PORT = 50051, 8080, 9003  # in a private netns

Rates = dict[tuple[str, int], tuple[float, float]]


def mooncake_rates(sizes: dict[str, int], batches: tuple[int, ...],
                   seconds: float) -> tuple[Rates | None, str]:
    """{(size_label, batch): (put_GBps, get_GBps)} measured with Mooncake Store over its TCP
    protocol, or (None, reason) when it cannot run here. The second item otherwise names the
    package version and the API used."""
    if not os.path.exists(VENV_PYTHON):
        return None, f"{PACKAGE} is not installed: {INSTALL}"
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")):
        return None, "Mooncake runs only in a private network namespace, which needs root " \
                     "and `unshare` and `ip` on PATH (util-linux, iproute2)"
    spec = json.dumps({"sizes": sizes, "batches": list(batches), "seconds": seconds})
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
           VENV_PYTHON, os.path.abspath(__file__), "--worker", spec]
    budget = 120 + 4 * seconds * len(sizes) * len(batches)
    out = _run_worker(cmd, budget)
    if out is None:
        return None, f"the Mooncake worker ran past {budget:.0f} s and was killed"
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return None, f"the Mooncake worker failed (exit {out.returncode}): " \
                     + _error_lines(out.stderr or out.stdout)
    result = json.loads(lines[-1])
    rates = {(label, batch): (put, get) for label, batch, put, get in result["rates"]}
    return rates, f"{PACKAGE} {result['version']}, {API}"


def _run_worker(cmd: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """Runs cmd in its own process group, all of which is killed on timeout or interrupt."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _error_lines(text: str, n: int = 6) -> str:
    """glog's E/F lines and the end of a traceback, not Mooncake's chatty I/W lines."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln[:1] in "EF" and ln[1:5].isdigit()]
    return " | ".join(lines[-3:] + errors[:n]) or "no output"


# ------------------------------------------------------------------ inside the namespace


class Endpoints(NamedTuple):
    master: str
    metadata: str


def _assert_private_netns() -> None:
    # if_nameindex() reads the current namespace (/sys/class/net may be the host's).
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:
        raise SystemExit(f"refusing to start Mooncake: interfaces {names}, want only lo "
                         "(run through mooncake_rates(), which uses unshare -n)")


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def _die_with_parent() -> None:
    # Runs in the child before exec: the kernel kills it if the worker dies uncleanly.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _start_master(log) -> subprocess.Popen:
    import mooncake
    exe = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    proc = subprocess.Popen(
        [exe, f"--rpc_port={MASTER_PORT}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={METADATA_PORT}", f"--metrics_port={METRICS_PORT}",
         "--enable_metric_reporting=false"],
        stdout=log, stderr=log, preexec_fn=_die_with_parent)
    _wait_port(MASTER_PORT, proc, "mooncake_master")
    _wait_port(METADATA_PORT, proc, "mooncake_master's metadata server")
    return proc


def _open_store(segment_bytes: int, local_buffer_bytes: int, ends: Endpoints):
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", ends.metadata, segment_bytes, local_buffer_bytes, "tcp",
                     "", ends.master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def _start_storage(ends: Endpoints, segment_bytes: int, log) -> subprocess.Popen:
    """Another process that holds the bytes; it lives until its stdin closes."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--storage",
                             ends.master, ends.metadata, str(segment_bytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                            preexec_fn=_die_with_parent)
    for line in proc.stdout:  # native logging may precede "ready"; EOF when it died
        if line.strip() == "ready":
            return proc
    proc.kill()
    raise RuntimeError(f"the storage process did not start (exit {proc.wait()})")


def storage_main(master: str, metadata: str, segment_bytes: str) -> None:
    _assert_private_netns()
    store = _open_store(int(segment_bytes), 0, Endpoints(master, metadata))
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


class Case:
    """One registered source and destination of `batch` blocks of `nbytes` each."""

    def __init__(self, store, nbytes: int, batch: int, round_: int) -> None:
        import numpy as np
        self.store, self.nbytes, self.batch = store, nbytes, batch
        self.src = np.random.default_rng(round_).integers(0, 256, nbytes * batch, np.uint8)
        self.dst = np.empty_like(self.src)
        for buf in (self.src, self.dst):
            _check(store.register_buffer(buf.ctypes.data, buf.nbytes), "register_buffer")
        self.ptrs_src = [self.src.ctypes.data + i * nbytes for i in range(batch)]
        self.ptrs_dst = [self.dst.ctypes.data + i * nbytes for i in range(batch)]
        self.sizes = [nbytes] * batch
        self.prefix, self.round = f"r{round_}-{nbytes}-{batch}", 0
        self.stored = self._fresh()
        self._put(self.stored)

    def _fresh(self) -> list[str]:
        self.round += 1
        return [f"{self.prefix}-{self.round}-{i}" for i in range(self.batch)]

    def _put(self, keys: list[str]) -> None:
        _check_all(self.store.batch_put_from(keys, self.ptrs_src, self.sizes), "batch_put_from")

    def put_rate(self, seconds: float) -> float:
        """Times the puts only; removing the fresh keys again keeps the segment bounded."""
        n, spent = 0, 0.0
        while spent < seconds or n < 3:
            keys = self._fresh()
            t0 = time.perf_counter()
            self._put(keys)
            spent += time.perf_counter() - t0
            n += 1
            _check_all(self.store.batch_remove(keys), "batch_remove")
        return n * self.nbytes * self.batch / spent / 1e9

    def get(self) -> None:
        got = self.store.batch_get_into(self.stored, self.ptrs_dst, self.sizes)
        if got != self.sizes:
            raise RuntimeError(f"batch_get_into read {got}, want {self.sizes}")

    def get_rate(self, seconds: float) -> float:
        self.dst[:] = 0
        self.get()
        if not (self.dst == self.src).all():
            raise RuntimeError("batch_get_into returned other bytes than were put")
        n, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < seconds or n < 3:
            self.get()
            n += 1
        return n * self.nbytes * self.batch / dt / 1e9

    def close(self) -> None:
        self.store.batch_remove(self.stored, True)
        for buf in (self.src, self.dst):
            self.store.unregister_buffer(buf.ctypes.data)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")


def _check_all(rcs: list[int], what: str) -> None:
    if any(rc != 0 for rc in rcs):
        raise RuntimeError(f"{what} returned {rcs}")


def measure(store, sizes: dict[str, int], batches: list[int], seconds: float) -> list:
    rows = []
    for label, nbytes in sizes.items():
        for batch in batches:
            case = Case(store, nbytes, batch, len(rows))
            try:
                rows.append([label, batch, case.put_rate(seconds), case.get_rate(seconds)])
            finally:
                case.close()
    return rows


def worker_main(spec: dict) -> None:
    import importlib.metadata
    _assert_private_netns()
    # The transfer engine skips loopback when it looks for its own address unless told;
    # the storage process inherits both settings.
    os.environ.update(MC_TCP_BIND_ADDRESS="127.0.0.1", MC_FORCE_TCP="1")
    ends = Endpoints(f"127.0.0.1:{MASTER_PORT}", f"http://127.0.0.1:{METADATA_PORT}/metadata")
    master = storage = None
    try:
        master = _start_master(sys.stderr)
        # The stored set and one in-flight put, with room for the allocator's slack.
        largest = max(spec["sizes"].values()) * max(spec["batches"])
        storage = _start_storage(ends, max(3 * largest, 64 * MiB), sys.stderr)
        store = _open_store(0, 0, ends)  # the measuring client holds no segment
        try:
            rows = measure(store, spec["sizes"], spec["batches"], spec["seconds"])
        finally:
            store.close()
        print(json.dumps({"version": importlib.metadata.version(PACKAGE), "rates": rows}))
    finally:
        for proc in (storage, master):
            if proc is not None:
                _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.stdin:
        proc.stdin.close()  # the storage process's cue to close cleanly
    else:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------ CLI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short run")
    p.add_argument("--selftest", action="store_true",
                   help="a few milliseconds per case, small blocks: does Mooncake run here?")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--storage", nargs=3, metavar=("MASTER", "METADATA", "BYTES"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.storage:
        return storage_main(*args.storage)
    if args.worker:
        return worker_main(json.loads(args.worker))
    if args.selftest:
        rates, note = mooncake_rates({"64KiB": 64 * KiB}, (1, 4), 0.02)
    else:
        sizes = {"256KiB": 256 * KiB, "1MiB": MiB, "4MiB": 4 * MiB}
        rates, note = mooncake_rates(sizes, (1, 16), 0.08 if args.quick else 0.4)
    print(f"mooncake: {note}")
    if rates is None:
        sys.exit(1)
    for (label, batch), (put, get) in rates.items():
        print(f"{label:>7} x{batch:<3} put {put:7.2f} GB/s   get {get:7.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"note": note, "rates": [
                {"size": label, "batch": batch, "put_GBps": put, "get_GBps": get}
                for (label, batch), (put, get) in rates.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
