"""What a node publishes about itself, and how a cluster address is written."""
from __future__ import annotations

import os
import time
from typing import NamedTuple
from urllib.parse import urlsplit

import msgspec

from kvstore.config import read_text_file
from kvstore.errors import ConfigError, KVStoreError
from transfer.codec import Record


class ClusterError(KVStoreError):
    """etcd is unreachable, or the cluster state is not what this node needs."""


class NodeRecord(Record, tag="node/2"):
    """A node's registration: where its planes listen and its transfer-agent metadata."""

    ERROR = ClusterError

    node_id: str
    data_addr: str                 # host:port of the binary data plane
    control_url: str               # http://host:port of the control plane
    agent_metadata: bytes = b""    # transfer.Agent.metadata() of the node
    started_at: float = msgspec.field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not self.node_id or "/" in self.node_id:
            raise ConfigError(f"node id {self.node_id!r} must be non-empty and contain no '/'")
        try:
            self.node_id.encode()
        except UnicodeEncodeError:  # (bytes not UTF-8 from a command line: a traceback)
            raise ConfigError(f"node id {self.node_id!r} is not valid UTF-8 text") from None
        # (a record naming "127.0.0.1:notaport", or "[127.0.0.1:5555]:7481" from an
        # --advertise with a port, made every pool client's put_n and get_n raise)
        if "://" in self.data_addr:  # (clients prefix their own: kvtier://kvtier://h:5)
            raise ConfigError(f"data address {self.data_addr!r} is HOST:PORT, no scheme")
        check_host_port(self.data_addr, "data address", ("kvtier",))
        check_host_port(self.control_url, "control url", ("http", "https"))


def check_host_port(addr: str, what: str, schemes: tuple[str, ...]) -> None:
    """ConfigError unless `addr` is HOST:PORT (with `schemes[0]`:// for a URL scheme
    among `schemes`, when it has one) and nothing else."""
    url = addr if "://" in addr else f"{schemes[0]}://{addr}"
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise ConfigError(f"{what} {addr!r} is not HOST:PORT ({e})") from None
    if (parts.scheme not in schemes or not host or port is None or not 0 < port < 65536
            or parts.path.strip("/") or parts.query or parts.fragment or parts.username
            or any(c.isspace() for c in addr)):
        raise ConfigError(f"{what} {addr!r} is not HOST:PORT"
                          + (f" behind {schemes[0]}://" if "://" in addr else ""))


class EtcdTls(NamedTuple):
    """TLS to etcd: the CA certificates etcd's own must chain to (PEM; None: the system's
    roots) and, where etcd asks its clients for a certificate (`--client-cert-auth`), this
    node's certificate chain and private key (PEM)."""
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def __repr__(self) -> str:  # (never the key)
        return (f"EtcdTls(ca={'given' if self.ca else 'system roots'}, "
                f"client_cert={'yes' if self.cert else 'no'})")


class EtcdAddress(NamedTuple):
    endpoints: tuple[tuple[str, int], ...]
    prefix: str
    credentials: tuple[str, str] | None = None  # (user, password) where etcd's auth is on
    tls: EtcdTls | None = None  # None: plain gRPC (etcd's http:// client URLs)

    def __repr__(self) -> str:  # (never the password, in a log line or a traceback)
        user = f", user={self.credentials[0]!r}" if self.credentials else ""
        tls = f", tls={self.tls!r}" if self.tls else ""
        return f"EtcdAddress(endpoints={self.endpoints!r}, prefix={self.prefix!r}{user}{tls})"


ETCD_SCHEMES = ("etcd", "etcds")  # etcds://: TLS (with the system's roots unless a CA is given)


def parse_etcd_url(url: str, credentials_file: str | None = None,
                   tls: EtcdTls | None = None) -> EtcdAddress:
    """'etcd://h1:2379,h2:2379/prefix' -> endpoints and key prefix (default '/kvtier'), with
    the user and password of `credentials_file` (`read_etcd_credentials`), if given. TLS
    (etcd serving https:// client URLs) with `tls` (`read_etcd_tls`), or with the system's
    roots for an `etcds://` address."""
    parts = urlsplit(url)
    if parts.scheme not in ETCD_SCHEMES or not parts.netloc:
        raise ConfigError(f"cluster address {url!r} must look like etcd://HOST:PORT[,HOST:PORT]/PREFIX"
                          " (etcds:// for etcd over TLS)")
    if "@" in parts.netloc:  # (a password in a URL shows in ps, logs and shell history)
        raise ConfigError("etcd credentials do not go in the cluster address: put USER:PASSWORD "
                          "in a file and pass it (--etcd-credentials-file, or "
                          "etcd_credentials_file= for a pool client)")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        # (urlsplit took them off the prefix, silently: two pools met under one)
        raise ConfigError(f"the prefix of cluster address {url!r} may not hold '?' or '#'")
    endpoints = []
    for hostport in parts.netloc.split(","):
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"etcd endpoint {hostport!r} in {url!r} needs HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    prefix = parts.path.rstrip("/") or "/kvtier"
    creds = read_etcd_credentials(credentials_file) if credentials_file else None
    if tls is None and parts.scheme == "etcds":
        tls = EtcdTls()
    return EtcdAddress(tuple(endpoints), prefix, creds, tls)


def read_etcd_credentials(path: str) -> tuple[str, str]:
    """(user, password) from a file whose first line that is not blank or a `#` comment
    is USER:PASSWORD (the password may hold ':'). Refused if other users may read it."""
    text, mode = read_text_file(path, "etcd credentials file")
    lines = [ln.strip() for ln in text]
    if mode & 0o077:
        raise ConfigError(f"etcd credentials file {path} can be read by other users (mode "
                          f"{mode & 0o777:o}): chmod 600 it")
    line = next((ln for ln in lines if ln and not ln.startswith("#")), "")
    user, colon, password = line.partition(":")
    if not colon or not user or not password:
        raise ConfigError(f"etcd credentials file {path}: its line is USER:PASSWORD")
    return user, password


def read_etcd_tls(ca_file: str | None = None, cert_file: str | None = None,
                  key_file: str | None = None) -> EtcdTls | None:
    """The TLS settings of these PEM files (None when none is given): `ca_file`, the CA
    that signed etcd's certificate (etcd's --trusted-ca-file is the one for clients; without
    it, the system's roots); `cert_file` and `key_file` together, this node's certificate
    for an etcd that asks for one (--client-cert-auth). A key file other users may read is
    refused."""
    if ca_file is None and cert_file is None and key_file is None:
        return None
    if (cert_file is None) != (key_file is None):
        raise ConfigError("an etcd client certificate needs both --etcd-cert-file and "
                          "--etcd-key-file (etcd_cert_file= and etcd_key_file=)")
    ca = _read_pem(ca_file, "etcd CA file", b"CERTIFICATE") if ca_file else None
    cert = _read_pem(cert_file, "etcd certificate file", b"CERTIFICATE") if cert_file else None
    key = None
    if key_file:
        key = _read_pem(key_file, "etcd key file", b"PRIVATE KEY")
        mode = os.stat(key_file).st_mode
        if mode & 0o077:
            raise ConfigError(f"etcd key file {key_file} can be read by other users (mode "
                              f"{mode & 0o777:o}): chmod 600 it")
    return EtcdTls(ca, cert, key)


def _read_pem(path: str, what: str, kind: bytes) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from e
    if b"-----BEGIN " not in data or kind not in data:
        raise ConfigError(f"{what} {path} holds no PEM {kind.decode()} (-----BEGIN ... "
                          f"{kind.decode()}-----)")
    return data
