"""Real `kvtier serve` processes on loopback ports the kernel picks, always stopped at
teardown (kvstore.daemon.process.DaemonProcess)."""
from __future__ import annotations

import os
import re
import time
import urllib.request

import numpy as np
import pytest

from kvstore.daemon.process import DaemonProcess
from kvstore.keys import Namespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NS = Namespace("test-model", num_layers=1, num_kv_heads=1, head_dim=64)  # 4 KiB blocks


def op_count(daemon, op: str, expect: float | None = None) -> float:
    """The daemon's count of `op` requests served. The daemon counts a request just after
    sending its reply, so with `expect` this waits (a little) for that count to land."""
    for _ in range(50):
        text = urllib.request.urlopen(daemon.http + "/metrics", timeout=5).read().decode()
        found = re.findall(rf'^kvtier_ops_total{{op="{op}",outcome="ok"}} (\S+)$', text, re.M)
        count = float(found[0]) if found else 0.0
        if expect is None or count >= expect:
            return count
        time.sleep(0.05)
    return count


def block_of(h: bytes, nbytes: int) -> np.ndarray:
    """Deterministic content of a block, so any process can check it byte for byte."""
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, nbytes, np.uint8)


class Daemon(DaemonProcess):
    """A `kvtier serve` of this checkout (cwd = the repository root). Set `python` to run it
    under another interpreter (an engine's venv holds only kvtier's client side)."""

    def __init__(self, data_dir: str, *extra: str, **kw) -> None:
        super().__init__(data_dir, *extra, cwd=ROOT, **kw)


@pytest.fixture
def make_daemon(tmp_path):
    started: list[Daemon] = []

    def make(*extra: str, data_dir: str | None = None, **kw) -> Daemon:
        d = Daemon(data_dir or str(tmp_path / "data"), *extra, **kw)
        started.append(d)
        return d.start()

    yield make
    for d in started:
        d.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("daemon") / "data"), "--reservation-timeout", "1")
    d.start()
    yield d
    d.close()
