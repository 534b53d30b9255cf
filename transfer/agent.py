"""`Agent`: registers memory, exchanges metadata with peers, prepares descriptor lists and
posts READ/WRITE transfers by index through the best backend per peer."""
from __future__ import annotations

import itertools
import os
import threading
import uuid
from collections import deque
from typing import Any

import msgspec
import numpy as np

from . import backends, forks
from .descriptors import DescList, Prepared, as_index
from .errors import Fault, TransferError
from .handle import Transfer
from .memory import Region, RegionTable, check_ranges
from .metadata import AgentMetadata, RegionInfo, host_id
from .types import AgentConfig, BackendKind, Notification, Op
from .backends.base import AgentContext, Backend, Grants, Job


class Agent:
    """One endpoint of the transfer layer (a process may hold several). Thread-safe for
    posting from several threads; register/add_peer are control-path calls. An agent does
    not cross os.fork(): in the child it is closed (`_after_fork`), the parent's untouched."""

    def __init__(self, name: str, config: AgentConfig | None = None):
        if not name:
            raise TransferError(Fault.INVALID, "an agent needs a name")
        self.name = name
        self.config = config or AgentConfig()
        self.agent_id = uuid.uuid4().hex
        self.regions = RegionTable()
        self._notes: deque[Notification] = deque()
        self.notes_dropped = 0  # notifications let go undrained (max_pending_notes)
        self._notes_cv = threading.Condition()
        self._peers: dict[str, AgentMetadata] = {}
        self._counter = itertools.count(1)
        self._closed = False
        self._grants = Grants(self.config.require_grant, self.config.max_conns_per_key)
        ctx = AgentContext(name, self.agent_id, self.config, self.regions, self._deliver,
                           self._grants)
        self._backends: dict[BackendKind, Backend] = {}
        try:
            for kind in self.config.backends:
                self._backends[kind] = backends.load(kind)(ctx)
        except BaseException:
            self.close()
            raise
        self._wire_notifiers()
        forks.track(self)

    def _wire_notifiers(self) -> None:
        shm, tcp = self._backends.get(BackendKind.SHM), self._backends.get(BackendKind.TCP)
        if shm is not None and tcp is not None:
            shm.notifier = tcp.notify

    # memory ---------------------------------------------------------------------------------

    def register(self, memory: Any, export: bool = True) -> Region:
        """Register a numpy array, torch tensor, ShmSegment, FileRegion or writable buffer.

        `export=False` keeps the region usable locally but invisible to peers. The caller keeps
        the memory alive and unchanged in size until `deregister`."""
        self._check_open()
        region = self.regions.add(memory, export)
        for b in self._backends.values():
            b.on_register(region)
        return region

    def deregister(self, region: Region) -> None:
        """Withdraw `region`: no peer reaches it once this returns (tcp peers' requests in
        progress on it end with their connections; a peer that cannot be stopped within
        io_timeout_s is a TransferError TIMEOUT here)."""
        for b in self._backends.values():
            b.on_deregister(region)
        for conn in self.regions.remove(region):
            conn.close()
        if not self.regions.wait_idle(region, self.config.io_timeout_s):
            raise TransferError(Fault.TIMEOUT, f"region {region.region_id}: a peer's request "
                                f"on it did not end within {self.config.io_timeout_s} s")

    # peers ----------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """What a peer needs to reach this agent: backends' addresses and exported regions."""
        self._check_open()
        fields: dict = {}
        for b in self._backends.values():
            fields.update(b.metadata_fields())
        infos = tuple(RegionInfo(r.region_id, r.size, r.kind, r.path, r.path_offset)
                      for r in self.regions.exported())
        return AgentMetadata(self.name, self.agent_id, host_id(), os.getpid(),
                             fields.get("tcp_addr"), infos, nixl=fields.get("nixl"),
                             ucx=fields.get("ucx")).encode()

    def grant(self, key: bytes) -> None:
        """Let peers presenting `key` (>= 16 random bytes) connect to this agent's tcp port
        (what `AgentConfig.require_grant` asks for). Hand the key out with the metadata."""
        self._check_open()
        self._grants.add(key)

    def revoke(self, key: bytes) -> None:
        """Withdraw a key: its peers' connections are closed and it opens nothing more."""
        for conn in self._grants.revoke(key):
            conn.close()

    def add_peer(self, metadata: bytes, key: bytes = b"") -> str:
        """Learn (or refresh) a peer from its `metadata()`; returns the peer's name. `key`:
        what that peer granted this side (when it requires one)."""
        self._check_open()
        meta = msgspec.structs.replace(AgentMetadata.decode(metadata), access_key=bytes(key))
        for b in self._backends.values():
            b.add_peer(meta)
        self._peers[meta.name] = meta
        return meta.name

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)
        for b in self._backends.values():
            b.remove_peer(name)

    def peer_regions(self, name: str) -> tuple[RegionInfo, ...]:
        return self._peer(name).regions

    def _peer(self, name: str) -> AgentMetadata:
        try:
            return self._peers[name]
        except KeyError:
            raise TransferError(Fault.UNKNOWN_PEER, f"peer {name!r} was never added") from None

    # descriptors ----------------------------------------------------------------------------

    def prepare(self, descs: DescList, peer: str | None = None,
                backend: BackendKind | None = None) -> Prepared:
        """Validate `descs` once: against this agent's regions (peer None) or against what
        `peer` exported, choosing the backend for that peer (or using `backend`)."""
        self._check_open()
        if peer is None:
            check_ranges(self.regions.sizes, descs.region_ids, descs.offsets, descs.lengths)
            regions = {i: self.regions.get(i) for i in np.unique(descs.region_ids).tolist()}
            return Prepared(self.name, None, None, descs, regions)
        meta = self._peer(peer)
        sizes = np.full(max((r.region_id for r in meta.regions), default=0) + 1, -1, np.int64)
        for r in meta.regions:
            sizes[r.region_id] = r.size
        check_ranges(sizes, descs.region_ids, descs.offsets, descs.lengths)
        return Prepared(self.name, peer, self._choose(meta, descs.region_ids, backend), descs)

    def _choose(self, meta: AgentMetadata, ids: np.ndarray,
                forced: BackendKind | None) -> BackendKind:
        kinds = (forced,) if forced is not None else self.config.backends
        for kind in kinds:
            b = self._backends.get(kind)
            if b is not None and b.reaches(meta, ids):
                return kind
        raise TransferError(Fault.UNSUPPORTED, f"no backend of {[k.value for k in kinds]} "
                            f"reaches those regions of peer {meta.name!r}")

    # transfers ------------------------------------------------------------------------------

    def post(self, op: Op, local: Prepared, local_idx: Any, remote: Prepared, remote_idx: Any,
             notify: bytes | None = None) -> Transfer:
        """Start moving bytes between local[local_idx[i]] and remote[remote_idx[i]].

        Raises TransferError at once for what can be checked now (bad indices, length
        mismatch, unregistered memory, unknown or departed peer); later failures are raised
        by the returned handle's poll()/wait()."""
        job, xfer = self._start(op, local, local_idx, remote, remote_idx, notify)
        try:
            self._backends[remote.backend].post(xfer, job)
        except TransferError as e:
            xfer._fail(e)
            raise e.for_transfer(xfer.name) from e
        except BaseException as e:  # (a bug or an interrupt: the handle still ends, not
            xfer._fail(TransferError(Fault.INVALID, f"posting failed: {e!r}"))  # pending)
            raise
        return xfer

    def transfer(self, op: Op, local: Prepared, local_idx: Any, remote: Prepared,
                 remote_idx: Any, timeout: float | None = None) -> None:
        """`post`, `wait(timeout)` and `release` in one call: the bytes have moved when it
        returns (TransferError if they could not). A backend that can move them on the
        calling thread does (tcp, on a connection with nothing else in flight), sparing
        the hand-offs a posted transfer takes to its threads and back; not with a
        `timeout` shorter than the agent's io_timeout_s, which bounds only a stall there (a
        peer trickling its bytes held transfer(timeout=1) for 4 s)."""
        job, xfer = self._start(op, local, local_idx, remote, remote_idx, None)
        backend = self._backends[remote.backend]
        run = getattr(backend, "run", None)
        if timeout is not None and timeout < self.config.io_timeout_s:
            run = None
        try:
            if run is None or not run(xfer, job):
                backend.post(xfer, job)
        except TransferError as e:
            xfer._fail(e)
            raise e.for_transfer(xfer.name) from e
        except BaseException as e:  # (as post)
            xfer._fail(TransferError(Fault.INVALID, f"posting failed: {e!r}"))
            raise
        xfer.wait(timeout)
        xfer.release()

    def _start(self, op: Op, local: Prepared, local_idx: Any, remote: Prepared,
               remote_idx: Any, notify: bytes | None) -> tuple[Job, Transfer]:
        """A checked job and its fresh handle (what `post` and `transfer` both begin with)."""
        self._check_open()
        op = Op(op)
        job = self._job(op, local, local_idx, remote, remote_idx, notify)
        xfer = Transfer(f"{self.name}#{next(self._counter)} {op.name} {remote.peer}", op,
                        remote.peer, int(job.lengths.size), int(job.lengths.sum()))
        return job, xfer

    def _job(self, op: Op, local: Prepared, local_idx: Any, remote: Prepared,
             remote_idx: Any, notify: bytes | None) -> Job:
        if local.peer is not None or local.agent != self.name:
            raise TransferError(Fault.INVALID, "local list was not prepared by this agent "
                                "with peer=None")
        if remote.peer is None or remote.agent != self.name:
            raise TransferError(Fault.INVALID, "remote list was not prepared for a peer here")
        li = as_index(local_idx, len(local), "local_idx")
        ri = as_index(remote_idx, len(remote), "remote_idx")
        if li.size != ri.size or li.size == 0:
            raise TransferError(Fault.INVALID, f"{li.size} local vs {ri.size} remote indices")
        lengths = local.descs.lengths[li]
        remote_lengths = remote.descs.lengths[ri]
        local_ids = local.descs.region_ids[li]
        if li.size == 1:  # one block, the common case: plain ints, no array reductions
            differ = int(lengths[0]) != int(remote_lengths[0])
            gone = self.regions.sizes[int(local_ids[0])] < 0
        else:
            differ = not np.array_equal(lengths, remote_lengths)
            gone = (self.regions.sizes[local_ids] < 0).any()
        if differ:
            raise TransferError(Fault.INVALID, "local and remote descriptor lengths differ")
        if gone:  # deregistered since prepare
            raise TransferError(Fault.UNREGISTERED, "a local region was deregistered")
        if notify is not None and not isinstance(notify, (bytes, bytearray)):
            raise TransferError(Fault.INVALID, "notify must be bytes")
        if notify is not None:
            self._check_note(notify)
        return Job(op, remote.peer, local.regions, local_ids, local.descs.offsets[li],
                   remote.descs.region_ids[ri], remote.descs.offsets[ri], lengths,
                   bytes(notify) if notify is not None else None)

    # notifications --------------------------------------------------------------------------

    def send_notification(self, peer: str, payload: bytes) -> Transfer:
        """A notification with no data; the handle is DONE once the peer has it."""
        self._check_open()
        self._check_note(payload)
        meta = self._peer(peer)
        kind = self._choose(meta, np.empty(0, np.int64), None)
        xfer = Transfer(f"{self.name}#{next(self._counter)} NOTIFY {peer}", Op.WRITE, peer,
                        0, 0)
        try:
            self._backends[kind].notify(peer, bytes(payload), xfer)
        except TransferError as e:
            xfer._fail(e)
            raise e.for_transfer(xfer.name) from e
        return xfer

    def _check_note(self, payload) -> None:
        if len(payload) > self.config.max_note_bytes:  # (the peer's limit is likely ours)
            raise TransferError(Fault.INVALID, f"a notification of {len(payload)} bytes: at "
                                f"most {self.config.max_note_bytes} (AgentConfig."
                                "max_note_bytes); send bigger data as a transfer")

    def _deliver(self, note: Notification) -> None:
        if len(note.payload) > self.config.max_note_bytes:  # (any backend's: see _check_note)
            with self._notes_cv:
                self.notes_dropped += 1
            return
        with self._notes_cv:
            self._notes.append(note)
            while len(self._notes) > self.config.max_pending_notes:
                self._notes.popleft()  # (kept in bound: see AgentConfig.max_pending_notes)
                self.notes_dropped += 1
            self._notes_cv.notify_all()

    def notifications(self, timeout: float = 0.0) -> list[Notification]:
        """Drain received notifications; with `timeout` > 0 wait that long for at least one."""
        with self._notes_cv:
            if not self._notes and timeout > 0:
                self._notes_cv.wait_for(lambda: bool(self._notes), timeout)
            notes = list(self._notes)
            self._notes.clear()
        return notes

    # lifecycle ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(Fault.CLOSED, f"agent {self.name!r} is closed")

    def _after_fork(self) -> None:
        """In a child made by os.fork(): closed, without closing anything of the parent's.
        A child had held the parent's listening socket and connections (and could shut
        them down: `close` on its copy ended the parent's server), and its exit unlinked
        the parent's shm control file, which its shm peers then could not attach."""
        self._closed = True
        for b in self._backends.values():
            forked = getattr(b, "forked", None)
            if forked is not None:
                forked()
        self._peers.clear()

    def close(self) -> None:
        """Close every backend (in-flight transfers fail) and forget peers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for b in reversed(list(self._backends.values())):
            b.close()
        self._peers.clear()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

