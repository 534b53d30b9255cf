"""Enums, configs and small value types shared by the agent and every backend."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class Op(enum.IntEnum):
    """Direction of a transfer, seen from the initiator: READ pulls remote → local."""

    READ = 1
    WRITE = 2


class State(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    RELEASED = "released"


class MemKind(enum.IntEnum):
    HOST = 1  # numpy array / CPU tensor in private process memory
    SHM = 2  # POSIX shared memory segment (/dev/shm), mappable by same-host peers
    FILE = 3  # a region of a file, mmapped; mappable by same-host peers
    DEVICE = 4  # accelerator tensor; reachable by copy through the host


class BackendKind(enum.Enum):
    LOCAL = "local"
    SHM = "shm"
    TCP = "tcp"
    NIXL = "nixl"
    UCX = "ucx"


DEFAULT_BACKENDS = (BackendKind.LOCAL, BackendKind.SHM, BackendKind.TCP)


@dataclass(frozen=True)
class AgentConfig:
    """How an agent moves data. Backends are tried in this order when choosing per peer."""

    backends: tuple[BackendKind, ...] = DEFAULT_BACKENDS
    tcp_host: str = "127.0.0.1"
    tcp_port: int = 0  # 0: any free port
    tcp_num_conns: int = 1  # connections per peer; transfers are spread round-robin
    tcp_sock_buf_bytes: int = 4 << 20
    io_timeout_s: float = 10.0  # no progress on a socket for this long → TransferError
    connect_timeout_s: float = 5.0
    max_frame_bytes: int = 1 << 32  # largest payload a peer may send in one frame
    # Only peers presenting a key this agent granted (`Agent.grant`) may connect to its tcp
    # port; without it, any peer that knows the agent id may (trusted networks only).
    require_grant: bool = False
    # Microseconds a tcp connection polls its socket before it sleeps in a receive: a
    # sleeping thread pays the CPU's wake-up when the bytes come (tens of us on a VM whose
    # idle vCPUs halt). Adaptive (transfer.sockio.Spin); 0 never polls; a connection not
    # admitted yet never polls.
    spin_us: float = 100.0
    # Notifications (a message with a transfer, or alone): at most `max_note_bytes` each (a
    # bigger one is a protocol error: its connection closes), and at most
    # `max_pending_notes` kept until `Agent.notifications` drains them (past it the oldest
    # go, counted in `Agent.notes_dropped`). Unbounded, a peer with a grant sent 64
    # notifications of 16 MiB to an agent that never drained them (a daemon's): +1 GiB.
    max_note_bytes: int = 64 << 10
    max_pending_notes: int = 4096
    # Descriptors a peer may name in one request (a sender splits bigger transfers into
    # requests of at most this many), and the connections one granted key may hold open.
    # Unbounded, one READ of 2M descriptors (a 48 MB header) took an agent from 34 MB to
    # 1.2 GB building its views, and one data-plane client of a daemon held 300 of its
    # agent's connections (a thread and two descriptors each) by reusing its key.
    max_descs: int = 1 << 16
    max_conns_per_key: int = 16

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("AgentConfig.backends must name at least one backend")
        for b in self.backends:
            if not isinstance(b, BackendKind):
                raise ValueError(f"AgentConfig.backends: {b!r} is not a BackendKind")
        if self.tcp_num_conns < 1:
            raise ValueError("AgentConfig.tcp_num_conns must be >= 1")
        if self.io_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("AgentConfig timeouts must be > 0")
        if not 0 <= self.spin_us <= 1e6:
            raise ValueError(f"AgentConfig.spin_us {self.spin_us} must be within 0..1e6")
        if self.max_note_bytes < 0 or self.max_pending_notes < 0:
            raise ValueError("AgentConfig.max_note_bytes and max_pending_notes must be >= 0")
        if self.max_descs < 1 or self.max_conns_per_key < 1:
            raise ValueError("AgentConfig.max_descs and max_conns_per_key must be >= 1")
        if not 0 <= self.tcp_port < 65536:
            raise ValueError(f"AgentConfig.tcp_port {self.tcp_port} out of range")


class Notification(NamedTuple):
    """A message a peer attached to a transfer, delivered after that transfer's data landed."""

    peer: str
    payload: bytes
