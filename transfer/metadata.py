"""Agent metadata exchanged between peers: a `transfer.codec.Record` (msgpack, tagged with
its version, types checked while decoding), never pickle."""
from __future__ import annotations

import os
import socket
import msgspec

from .codec import Record
from .errors import Fault, TransferError
from .types import MemKind


def host_id() -> str:
    """Same value for every process of one booted host (shm is only shared within it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


class RegionInfo(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A region a peer may address: id, size, kind, and a path when it is mappable."""

    region_id: int
    size: int
    kind: MemKind
    path: str | None = None
    path_offset: int = 0

    def __post_init__(self) -> None:
        # (a negative id overwrote another region's size in prepare's lookup table, so an
        # offset of 1 GiB passed the local check against a 4 KiB region; an id of 1e11 had
        # prepare allocate a 745 GiB table)
        if not 0 <= self.region_id < 1 << 31 or self.size <= 0 or self.path_offset < 0:
            raise ValueError(f"region {self.region_id} of {self.size} bytes at "
                             f"{self.path_offset}: ids are in [0, 2**31), sizes > 0")


class _MetadataError(TransferError):
    """A malformed metadata blob (a TransferError with fault PROTOCOL)."""

    def __init__(self, message: str) -> None:
        super().__init__(Fault.PROTOCOL, message)


class AgentMetadata(Record, tag="agent/2"):
    ERROR = _MetadataError

    name: str
    agent_id: str  # unique per agent instance (a restarted peer gets a new one)
    host: str
    pid: int
    tcp_addr: tuple[str, int] | None
    regions: tuple[RegionInfo, ...]
    # opaque connection blobs of the optional adapters, each encoded by its own backend
    # (msgpack there too); None when this agent does not run that backend
    nixl: bytes | None = None
    ucx: bytes | None = None
    # The key this side presents to that peer: set by `Agent.add_peer(key=)`, whatever a
    # peer's own blob says (an agent publishes none).
    access_key: bytes = b""

    def __post_init__(self) -> None:
        if not self.name or not self.agent_id:
            raise ValueError("agent metadata without name or id")

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
