"""Agent metadata exchanged between peers: msgpack of plain fields, versioned, never pickle."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import msgpack

from .errors import Fault, TransferError
from .types import MemKind

METADATA_VERSION = 1


def host_id() -> str:
    """Same value for every process of one booted host (shm is only shared within it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class RegionInfo:
    """A region a peer may address: id, size, kind, and a path when it is mappable."""

    region_id: int
    size: int
    kind: MemKind
    path: str | None = None
    path_offset: int = 0


@dataclass(frozen=True)
class AgentMetadata:
    name: str
    agent_id: str  # unique per agent instance (a restarted peer gets a new one)
    host: str
    pid: int
    tcp_addr: tuple[str, int] | None
    regions: tuple[RegionInfo, ...]
    version: int = METADATA_VERSION
    # opaque connection blobs of the optional adapters, each encoded by its own backend
    # (msgpack there too); None when this agent does not run that backend
    nixl: bytes | None = None
    ucx: bytes | None = None
    # Never on the wire: the key this side presents to that peer (`Agent.add_peer(key=)`).
    access_key: bytes = field(default=b"", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.version != METADATA_VERSION:
            raise TransferError(Fault.PROTOCOL, f"agent metadata version {self.version}, "
                                f"expected {METADATA_VERSION}")
        if not self.name or not self.agent_id:
            raise TransferError(Fault.PROTOCOL, "agent metadata without name or id")

    def encode(self) -> bytes:
        regions = [[r.region_id, r.size, int(r.kind), r.path, r.path_offset]
                   for r in self.regions]
        tcp = list(self.tcp_addr) if self.tcp_addr else None
        return msgpack.packb([self.version, self.name, self.agent_id, self.host, self.pid,
                              tcp, regions, self.nixl, self.ucx], use_bin_type=True)

    @classmethod
    def decode(cls, blob: bytes) -> "AgentMetadata":
        try:
            version, name, agent_id, host, pid, tcp, regions, *extra = msgpack.unpackb(
                blob, raw=False, strict_map_key=True)
            nixl, ucx = (list(extra) + [None, None])[:2]  # absent in older metadata
            infos = tuple(RegionInfo(int(i), int(s), MemKind(k), p, int(po))
                          for i, s, k, p, po in regions)
            addr = (str(tcp[0]), int(tcp[1])) if tcp else None
            return cls(str(name), str(agent_id), str(host), int(pid), addr, infos, int(version),
                       _blob(nixl), _blob(ucx))
        except TransferError:
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise TransferError(Fault.PROTOCOL, f"malformed agent metadata: {e}") from e

    @property
    def local_pid_alive(self) -> bool:
        """Only meaningful for a peer on this host."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _blob(value) -> bytes | None:
    if value is not None and not isinstance(value, bytes):
        raise TypeError(f"adapter metadata must be bytes, got {type(value).__name__}")
    return value
