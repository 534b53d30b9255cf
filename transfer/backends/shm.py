"""`shm`: a same-host peer's exported shm/file regions are mapped here once; a transfer is a
copy between mappings, no socket on the data path.

Liveness and revocation go through a small control segment each agent publishes
(`kvt-ctl-<agent_id>`): byte 0 is 1 while the agent is open, byte i is 1 while region i is
exported. A post checks them (vectorized) and the peer's pid before copying. Notifications
go over the notifier the agent supplies (the tcp control path), after the copy.

A peer's region is a file this process maps: a peer that truncates it (a bug, or a hostile
process of the same user) leaves pages no copy can reach. Copies are guarded
(`transfer.copy.copy_runs`'s `guard`): such a transfer fails (UNREGISTERED), where the
SIGBUS used to kill this process.
"""
from __future__ import annotations

import os
import weakref
from typing import Callable

import numpy as np

from ..copy import Unreachable, copy_job, guarded_copy
from ..errors import Fault, TransferError
from ..handle import Transfer
from ..memory import Region
from ..metadata import AgentMetadata, host_id
from ..shm import ShmSegment, map_path
from ..types import BackendKind, Op
from .base import AgentContext, Job
from .local import buffer_of

CTL_SLOTS = 1 << 16  # region ids below this can be reached through shm


def ctl_name(agent_id: str) -> str:
    return f"kvt-ctl-{agent_id}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _map(p: "_Peer", ids: list[int]) -> None:
    """Map the peer's regions `ids` not mapped yet (TransferError PEER_GONE if one cannot)."""
    for i in ids:
        if i not in p.maps:
            info = p.infos[i]
            try:
                p.maps[i], p.views[i] = map_path(info.path, info.size, info.path_offset)
            except (OSError, ValueError) as e:
                raise TransferError(Fault.PEER_GONE, f"cannot map region {i} of peer "
                                    f"{p.meta.name!r}: {e}") from e


class _Peer:
    def __init__(self, meta: AgentMetadata, ctl: ShmSegment):
        self.meta = meta
        self.ctl = ctl
        self.infos = {r.region_id: r for r in meta.regions}
        self.maps: dict[int, object] = {}  # region id → mmap (kept open)
        self.views: dict[int, np.ndarray] = {}  # region id → uint8 view of the mapping

    def close(self) -> None:
        self.views.clear()
        self.maps.clear()
        self.ctl.close()


class ShmBackend:
    kind = BackendKind.SHM

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self._host = host_id()
        self._ctl = ShmSegment.create(CTL_SLOTS, ctl_name(ctx.agent_id))
        self._ctl.array[0] = 1
        # an agent never closed (its process exited without close) left its 64 KiB control
        # file in /dev/shm for good: unlinked at interpreter exit too (a SIGKILL still
        # leaves it: the file must outlive this process's start for peers to attach)
        self._unlink_at_exit = weakref.finalize(self, _unlink, self._ctl.path)
        self._peers: dict[str, _Peer] = {}
        self.notifier: Callable[[str, bytes, Transfer], None] | None = None  # set by the agent

    def metadata_fields(self) -> dict:
        return {}

    def on_register(self, region: Region) -> None:
        if region.exported and region.path and region.region_id < CTL_SLOTS:
            self._ctl.array[region.region_id] = 1

    def on_deregister(self, region: Region) -> None:
        if region.region_id < CTL_SLOTS:
            self._ctl.array[region.region_id] = 0

    def add_peer(self, peer: AgentMetadata) -> None:
        old = self._peers.get(peer.name)
        if old is not None and old.meta.agent_id == peer.agent_id and peer.host == self._host:
            # refreshed region list, same agent: its mappings stay (dropped, a list
            # prepared before the refresh failed its next post with a bare KeyError),
            # but those of regions that changed or went
            infos = {r.region_id: r for r in peer.regions}
            for i in [i for i in old.maps if infos.get(i) != old.infos.get(i)]:
                del old.maps[i]
                old.views.pop(i, None)
            old.meta, old.infos = peer, infos
            return
        self.remove_peer(peer.name)
        if peer.host != self._host:
            return
        try:
            ctl = ShmSegment.attach(ctl_name(peer.agent_id), CTL_SLOTS)
        except (OSError, ValueError):  # (a ctl file shorter than its slots: ValueError)
            return  # the peer runs without shm; another backend will serve it
        self._peers[peer.name] = _Peer(peer, ctl)

    def remove_peer(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is not None:
            peer.close()

    def reaches(self, peer: AgentMetadata, remote_ids: np.ndarray) -> bool:
        p = self._peers.get(peer.name)
        if p is None or p.meta.agent_id != peer.agent_id:
            return False
        ids = np.unique(remote_ids).tolist()
        if any(i >= CTL_SLOTS or i not in p.infos or not p.infos[i].path for i in ids):
            return False
        _map(p, ids)
        return True

    def _live_peer(self, name: str, remote_ids: np.ndarray) -> _Peer:
        p = self._peers.get(name)
        if p is None:
            raise TransferError(Fault.UNKNOWN_PEER, f"peer {name!r} is not reachable by shm")
        # the flags read through a guarded copy: a peer that truncated its control file
        # (a bug, or a hostile process of the same user) killed this one with SIGBUS
        flags = np.empty(int(remote_ids.max()) + 1 if len(remote_ids) else 1, np.uint8)
        if not guarded_copy(flags, p.ctl.array[:len(flags)]):
            raise TransferError(Fault.PEER_GONE, f"peer {name!r}'s control segment was "
                                "truncated: it cannot be reached by shm")
        if flags[0] != 1 or not p.meta.local_pid_alive:
            raise TransferError(Fault.PEER_GONE, f"peer {name!r} (pid {p.meta.pid}) has gone")
        if (flags[remote_ids] != 1).any():
            bad = int(remote_ids[flags[remote_ids] != 1][0])
            raise TransferError(Fault.UNREGISTERED, f"peer {name!r} no longer exports "
                                f"region {bad}")
        return p

    def post(self, xfer: Transfer, job: Job) -> None:
        p = self._live_peer(job.peer, job.remote_ids)
        ids = np.unique(job.remote_ids).tolist()
        if any(i not in p.views for i in ids):  # (its mapping dropped by a refresh)
            if any(i not in p.infos or not p.infos[i].path for i in ids):
                raise TransferError(Fault.UNREGISTERED, f"peer {job.peer!r} no longer "
                                    "exports a region of this list: prepare it again")
            _map(p, ids)
        local = {i: buffer_of(r) for i, r in job.local_regions.items()}
        try:
            copy_job(job.op is Op.WRITE, local, job.local_ids, job.local_offsets, p.views,
                     job.remote_ids, job.remote_offsets, job.lengths, guard=True)
        except Unreachable as e:  # (a SIGBUS caught: the file shrunk under the mapping)
            p.maps.pop(e.region, None)  # (mapped again by the next post, if it can be)
            p.views.pop(e.region, None)
            raise TransferError(Fault.UNREGISTERED, f"region {e.region} of peer {job.peer!r} "
                                "(or a local buffer) no longer reaches the bytes this "
                                "transfer named: its file was truncated under the mapping; "
                                "the transfer's destination holds an unknown part of it")
        if job.notify is None:
            xfer._done_part()
        else:
            self.notify(job.peer, job.notify, xfer)

    def notify(self, peer: str, payload: bytes, xfer: Transfer) -> None:
        if self.notifier is None:
            raise TransferError(Fault.UNSUPPORTED, "shm notifications need the tcp backend")
        self.notifier(peer, payload, xfer)

    def forked(self) -> None:
        """The control file is the parent's: never marked closed nor unlinked from here."""
        self._unlink_at_exit.detach()
        self._peers = {}

    def close(self) -> None:
        self._ctl.array[0] = 0
        for name in list(self._peers):
            self.remove_peer(name)
        self._ctl.close()
        self._unlink_at_exit.detach()
