"""What a node publishes about itself, and how a cluster address is written."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

import msgpack

from kvstore.errors import ConfigError, KVStoreError

RECORD_VERSION = 1


class ClusterError(KVStoreError):
    """etcd is unreachable, or the cluster state is not what this node needs."""


@dataclass(frozen=True)
class NodeRecord:
    """A node's registration: where its planes listen and its transfer-agent metadata."""

    node_id: str
    data_addr: str                 # host:port of the binary data plane
    control_url: str               # http://host:port of the control plane
    agent_metadata: bytes = b""    # transfer.Agent.metadata() of the node
    started_at: float = field(default_factory=time.time)
    version: int = RECORD_VERSION

    def __post_init__(self) -> None:
        if not self.node_id or "/" in self.node_id:
            raise ConfigError(f"node id {self.node_id!r} must be non-empty and contain no '/'")

    def encode(self) -> bytes:
        return msgpack.packb([self.version, self.node_id, self.data_addr, self.control_url,
                              self.agent_metadata, self.started_at], use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> "NodeRecord":
        try:
            version, node_id, data_addr, control_url, meta, started = msgpack.unpackb(raw, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise ClusterError(f"unreadable node record in etcd: {e}") from e
        if version != RECORD_VERSION:
            raise ClusterError(f"node record version {version}; this build reads {RECORD_VERSION}")
        return cls(node_id, data_addr, control_url, meta, started, version)


class EtcdAddress(NamedTuple):
    endpoints: tuple[tuple[str, int], ...]
    prefix: str


def parse_etcd_url(url: str) -> EtcdAddress:
    """'etcd://h1:2379,h2:2379/prefix' -> endpoints and key prefix (default '/kvtier')."""
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc:
        raise ConfigError(f"cluster address {url!r} must look like etcd://HOST:PORT[,HOST:PORT]/PREFIX")
    endpoints = []
    for hostport in parts.netloc.split(","):
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"etcd endpoint {hostport!r} in {url!r} needs HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    prefix = parts.path.rstrip("/") or "/kvtier"
    return EtcdAddress(tuple(endpoints), prefix)
