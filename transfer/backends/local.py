"""`local`: both agents live in this process; a transfer is a direct copy (torch for device)."""
from __future__ import annotations

import threading

import numpy as np

from ..copy import copy_job
from ..errors import Fault, TransferError
from ..handle import Transfer
from ..memory import Region, check_ranges
from ..metadata import AgentMetadata
from ..types import BackendKind, Notification, Op
from .base import AgentContext, Job

_AGENTS: dict[str, AgentContext] = {}  # agent_id → context, for agents alive in this process
_AGENTS_LOCK = threading.Lock()


def in_this_process(agent_id: str) -> bool:
    return agent_id in _AGENTS


def buffer_of(region: Region):
    return region.host if region.host is not None else region.device


class _Buffers:
    """region id → buffer, looked up on demand (only for the runs actually copied)."""

    def __init__(self, table):
        self.table = table

    def __getitem__(self, region_id: int):
        return buffer_of(self.table.get(region_id))


class LocalBackend:
    kind = BackendKind.LOCAL

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self._peers: dict[str, str] = {}  # peer name → agent_id
        with _AGENTS_LOCK:
            _AGENTS[ctx.agent_id] = ctx

    def metadata_fields(self) -> dict:
        return {}

    def on_register(self, region: Region) -> None:
        pass

    def on_deregister(self, region: Region) -> None:
        pass

    def add_peer(self, peer: AgentMetadata) -> None:
        self._peers[peer.name] = peer.agent_id

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)

    def reaches(self, peer: AgentMetadata, remote_ids: np.ndarray) -> bool:
        return peer.agent_id in _AGENTS

    def _peer_ctx(self, name: str) -> AgentContext:
        agent_id = self._peers.get(name)
        if agent_id is None:
            raise TransferError(Fault.UNKNOWN_PEER, f"peer {name!r} was never added")
        ctx = _AGENTS.get(agent_id)
        if ctx is None:
            raise TransferError(Fault.PEER_GONE, f"peer {name!r} has closed")
        return ctx

    def post(self, xfer: Transfer, job: Job) -> None:
        peer = self._peer_ctx(job.peer)
        check_ranges(peer.regions.exported_sizes, job.remote_ids, job.remote_offsets,
                     job.lengths)
        local = {i: buffer_of(r) for i, r in job.local_regions.items()}
        remote = _Buffers(peer.regions)
        copy_job(job.op is Op.WRITE, local, job.local_ids, job.local_offsets, remote,
                 job.remote_ids, job.remote_offsets, job.lengths)
        if job.notify is not None:
            peer.deliver(Notification(self.ctx.name, job.notify))
        xfer._done_part()

    def notify(self, peer: str, payload: bytes, xfer: Transfer) -> None:
        self._peer_ctx(peer).deliver(Notification(self.ctx.name, payload))
        xfer._done_part()

    def forked(self) -> None:
        _AGENTS.pop(self.ctx.agent_id, None)  # (no lock: a parent's thread may have held it)
        self._peers.clear()

    def close(self) -> None:
        with _AGENTS_LOCK:
            _AGENTS.pop(self.ctx.agent_id, None)
        self._peers.clear()
