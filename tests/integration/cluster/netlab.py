"""Test hosts in network namespaces: each host its own address on one switched LAN.

A `switch` namespace holds a bridge; every host namespace is joined to it by a veth pair,
so a host can be cut off (its switch port set down) and healed. Addresses are in a
10.x.y.0/24 picked per lab; no traffic leaves these namespaces.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess


def netns_available() -> str | None:
    """None when namespaces can be made here, else the reason they can't."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"kvt-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetLab:
    def __init__(self, hosts: int) -> None:
        self.tag = f"kvt{os.getpid() % 10000}{random.randrange(100)}"
        self.subnet = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.procs: list[subprocess.Popen] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            _ip("netns", "add", host)
            _ip("-n", host, "link", "set", "lo", "up")
            port = f"p{i}"
            _ip("link", "add", port, "netns", self.switch, "type", "veth", "peer", "name",
                "eth0", "netns", host)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", host, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def cmd(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i], *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(self.cmd(i, argv), **kw)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(i, argv), capture_output=True, text=True, timeout=timeout_s)

    def cut(self, i: int) -> None:
        """Partition host i from everyone (its switch port goes down)."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for ns in [*self.hosts, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
