"""A store node and its clients from `pip install kvtier` alone (no extras): run by `make
test-wheel` with the wheel's own venv, from outside the checkout. torch is not installed
there; the daemon serves, and a client puts and reads back blocks over shared memory and
over TCP, exact, with no torch loaded in either process; the engine's commands say which
extra to install instead of dying in an import."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

import numpy as np

from kvstore import Client
from kvstore.daemon.process import DaemonProcess
from kvstore.keys import Namespace, hash_blocks


def main() -> None:
    assert importlib.util.find_spec("torch") is None, "the store-only install pulled torch"
    assert "kvtier" not in os.getcwd(), "run it from outside the checkout"
    ns = Namespace("wheel-check", num_layers=2, num_kv_heads=2, head_dim=64)
    with tempfile.TemporaryDirectory() as workdir:
        daemon = DaemonProcess(workdir, dram_size="32MiB", ssd_size="32MiB").start()
        try:
            for k, opts in enumerate(({}, {"use_shm": False})):
                with Client(daemon.url, namespace=ns, **opts) as c:
                    assert c.transport == ("shm" if not opts else "tcp"), c.transport
                    hs = hash_blocks(ns, np.arange(8 * ns.block_tokens) + 1000 * k)
                    data = np.random.default_rng(k).integers(0, 256, (8, ns.block_bytes),
                                                             dtype=np.uint8)
                    assert all(s.value == "stored" for s in c.put_n(hs, data))
                    out = np.zeros_like(data)
                    assert None not in c.get_n(hs, out) and np.array_equal(out, data)
            maps = open(f"/proc/{daemon.pid}/maps").read()
            assert "libtorch" not in maps, "the daemon loaded torch"
        finally:
            daemon.stop()
    assert "torch" not in sys.modules
    demo = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert demo.returncode == 2 and "pip install 'kvtier[hf]'" in demo.stderr, demo
    print("store-only install: daemon and client served with no torch; "
          "`kvtier demo` names the extra it needs")


if __name__ == "__main__":
    main()
