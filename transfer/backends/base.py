"""The backend contract. One file per backend; the agent imports a backend only when chosen.

A backend moves the bytes of a `Job` between this agent's registered memory and one peer's,
and finishes the job's `Transfer` exactly once: `_done_part()` after every byte has landed
(and, if the job carries a notification, after the peer has it), or `_fail(TransferError)`.
It must do so within bounded time (`AgentConfig.io_timeout_s`), whatever the peer does.
"""
from __future__ import annotations

import hmac
import os
import threading

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from ..handle import Transfer
from ..memory import Region, RegionTable
from ..metadata import AgentMetadata
from ..types import AgentConfig, BackendKind, Notification, Op


@dataclass(frozen=True)
class AgentContext:
    """What a backend may use of its agent."""

    name: str
    agent_id: str
    config: AgentConfig
    regions: RegionTable
    deliver: Callable[[Notification], None]  # hand a notification to this agent's queue
    grants: "Grants"


class Grants:
    """The keys peers must present to reach this agent's ports (when the agent requires
    one). Checked in constant time; a revoked key ends the connections that used it."""

    def __init__(self, required: bool, max_conns_per_key: int = 16) -> None:
        self.required = required
        self.max_conns_per_key = max_conns_per_key
        self._lock = threading.Lock()
        self._keys: dict[bytes, set] = {}  # key -> live connections that presented it

    def add(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("an access key needs at least 16 random bytes")
        with self._lock:
            self._keys.setdefault(bytes(key), set())

    def admit(self, key, conn) -> bool:
        """Whether `key` opens this agent (a granted key, holding fewer than
        `max_conns_per_key` connections); if so `conn` is tracked under it."""
        if not self.required:
            return True
        if not isinstance(key, bytes):
            return False
        with self._lock:
            match = None
            for known in self._keys:  # every key compared: timing says nothing
                if hmac.compare_digest(known, key):
                    match = known
            if match is None or len(self._keys[match]) >= self.max_conns_per_key:
                return False
            self._keys[match].add(conn)
            return True

    def forget(self, conn) -> None:
        with self._lock:
            for conns in self._keys.values():
                conns.discard(conn)

    def revoke(self, key: bytes) -> list:
        """Drop a key; returns the connections that used it (the caller closes them)."""
        with self._lock:
            return list(self._keys.pop(bytes(key), ()))


@dataclass(frozen=True, eq=False)
class Job:
    """One transfer's descriptors, already selected by index and validated locally.

    Arrays are parallel, one entry per descriptor; `local_regions` maps the local region ids
    to their registrations (snapshot taken at prepare time).
    """

    op: Op
    peer: str
    local_regions: dict[int, Region]
    local_ids: np.ndarray
    local_offsets: np.ndarray
    remote_ids: np.ndarray
    remote_offsets: np.ndarray
    lengths: np.ndarray
    notify: bytes | None


class Backend(Protocol):
    kind: BackendKind

    def metadata_fields(self) -> dict:
        """Connection info this backend adds to the agent metadata (e.g., tcp address)."""

    def on_register(self, region: Region) -> None:
        """A region was registered on this agent (side effect: may publish it to peers)."""

    def on_deregister(self, region: Region) -> None:
        """A region was deregistered; peers must no longer reach it through this backend."""

    def add_peer(self, peer: AgentMetadata) -> None:
        """Learn a peer; may connect lazily. Re-adding a name replaces the old peer."""

    def remove_peer(self, name: str) -> None:
        """Forget a peer and drop its connections/mappings; in-flight transfers fail."""

    def reaches(self, peer: AgentMetadata, remote_ids: np.ndarray) -> bool:
        """Whether this backend can address those regions of that peer (may map them now)."""

    def post(self, xfer: Transfer, job: Job) -> None:
        """Start moving the bytes; never blocks for the whole transfer on the network."""

    def notify(self, peer: str, payload: bytes, xfer: Transfer) -> None:
        """Deliver `payload` to the peer; finish `xfer` once it is delivered."""

    def close(self) -> None:
        """Stop threads, close sockets and mappings; pending transfers fail."""

    def forked(self) -> None:
        """In a child made by os.fork(): let go of this process's copies of the parent's
        descriptors (closed here only: no shutdown, nothing sent, no lock taken) and of
        anything that would touch the parent's state, now or at exit."""


def quiet_ucx_without_rdma() -> None:
    """Before UCX loads (nixl / ucx adapters): on a host with libibverbs installed but no
    RDMA device, UCX's ib module crashes the interpreter at exit (seen with libibverbs1
    44.0 and libucx 1.21); leave it out unless the user chose UCX_MODULES themselves."""
    ib = "/sys/class/infiniband"
    if not (os.path.isdir(ib) and os.listdir(ib)):
        os.environ.setdefault("UCX_MODULES", "^ib")
