"""What a node publishes about itself, and how a cluster address is written."""
from __future__ import annotations

import time
from typing import NamedTuple
from urllib.parse import urlsplit

import msgspec

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


class EtcdAddress(NamedTuple):
    endpoints: tuple[tuple[str, int], ...]
    prefix: str


def parse_etcd_url(url: str) -> EtcdAddress:
    """'etcd://h1:2379,h2:2379/prefix' -> endpoints and key prefix (default '/kvtier')."""
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc:
        raise ConfigError(f"cluster address {url!r} must look like etcd://HOST:PORT[,HOST:PORT]/PREFIX")
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
    return EtcdAddress(tuple(endpoints), prefix)
