"""`tcp`: any host. Each agent serves its exported memory on a listening socket
(`tcp_server`); to reach a peer it opens `tcp_num_conns` connections lazily (`tcp_conn`)
and spreads transfers over them. Also the control path for shm notifications."""
from __future__ import annotations

import itertools
import threading

import numpy as np

from ..errors import Fault, TransferError
from ..handle import Transfer
from ..memory import Region, host_views
from ..metadata import AgentMetadata
from ..types import BackendKind, Op
from .base import AgentContext, Job
from .tcp_conn import PeerConnection, PendingOp
from .tcp_server import Server
from .tcp_wire import Kind, frame


class _PeerConns:
    def __init__(self, meta: AgentMetadata, num_conns: int):
        self.meta = meta
        self.conns: list[PeerConnection | None] = [None] * num_conns
        self.rr = itertools.count()
        self.lock = threading.Lock()

    def close(self) -> None:
        for c in self.conns:
            if c is not None:
                c.close()


class TcpBackend:
    kind = BackendKind.TCP

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.server = Server(ctx)
        self._peers: dict[str, _PeerConns] = {}

    def metadata_fields(self) -> dict:
        return {"tcp_addr": tuple(self.server.addr)}

    def on_register(self, region: Region) -> None:
        pass

    def on_deregister(self, region: Region) -> None:
        pass

    def add_peer(self, peer: AgentMetadata) -> None:
        old = self._peers.get(peer.name)
        if old is not None and old.meta.agent_id == peer.agent_id:
            old.meta = peer  # refreshed region list, same agent: keep the connections
            return
        self.remove_peer(peer.name)
        if peer.tcp_addr is not None:
            self._peers[peer.name] = _PeerConns(peer, self.ctx.config.tcp_num_conns)

    def remove_peer(self, name: str) -> None:
        old = self._peers.pop(name, None)
        if old is not None:
            old.close()

    def reaches(self, peer: AgentMetadata, remote_ids: np.ndarray) -> bool:
        return peer.tcp_addr is not None and peer.name in self._peers

    def _conn(self, name: str) -> PeerConnection:
        """A live connection to the peer, round-robin; reconnects a dead slot lazily."""
        p = self._peers.get(name)
        if p is None:
            raise TransferError(Fault.UNKNOWN_PEER, f"peer {name!r} is not reachable by tcp")
        with p.lock:
            slot = next(p.rr) % len(p.conns)
            conn = p.conns[slot]
            if conn is None or conn.dead:
                if conn is not None:
                    conn.close()
                p.conns[slot] = None
                conn = PeerConnection(self.ctx.config, p.meta.tcp_addr, p.meta.agent_id,
                                  self.ctx.name, p.meta.access_key)
                p.conns[slot] = conn
            return conn

    def post(self, xfer: Transfer, job: Job) -> None:
        parts = self._split(job)
        xfer._set_parts(len(parts))
        # a notification goes with the last part, and all parts on one connection (served
        # in order): it is delivered after every byte landed
        for k, sel in enumerate(parts):
            try:
                if k == 0 or job.notify is None:
                    conn = self._conn(job.peer)
                conn.submit(self._request(conn.next_seq(), xfer, job, sel,
                                          job.notify if k == len(parts) - 1 else None))
            except BaseException:
                xfer._unstarted(len(parts) - k - 1)  # (this part: the agent's _fail)
                raise

    def run(self, xfer: Transfer, job: Job) -> bool:
        """The whole transfer on the calling thread, when it goes as one request and the
        connection it falls to is idle (see PeerConnection.run_inline); False: post it."""
        if job.notify is not None or len(self._split(job)) > 1:
            return False
        conn = self._conn(job.peer)
        return conn.run_inline(self._request(conn.next_seq(), xfer, job, slice(None), None))

    def _split(self, job: Job) -> list[np.ndarray | slice]:
        """One part per connection for big batches (not with a notification: see post),
        and no part of more than `max_descs` descriptors (what a peer takes a request)."""
        size, cfg = job.lengths.size, self.ctx.config
        n = min(cfg.tcp_num_conns, size)
        if n <= 1 or job.notify is not None or int(job.lengths.sum()) < (4 << 20):
            n = 1
        n = max(n, -(-size // cfg.max_descs))
        return [slice(None)] if n <= 1 else list(np.array_split(np.arange(size), n))

    def _request(self, seq: int, xfer: Transfer, job: Job, sel,
                 notify: bytes | None) -> PendingOp:
        ids, offs, lens = job.remote_ids[sel], job.remote_offsets[sel], job.lengths[sel]
        wire = [seq, ids.astype("<i8").tobytes(), offs.astype("<i8").tobytes(),
                lens.astype("<i8").tobytes()]
        incoming = job.op is Op.READ
        views, finish = host_views(job.local_regions, job.local_ids[sel],
                                   job.local_offsets[sel], lens, incoming)
        nbytes = int(lens.sum())
        if incoming:
            return PendingOp(seq, Kind.READ, frame(Kind.READ, wire + [None]), xfer, recv=views,
                           recv_bytes=nbytes, finish=finish, then_notify=notify)
        return PendingOp(seq, Kind.WRITE, frame(Kind.WRITE, wire + [notify], nbytes), xfer,
                       send=views)

    def notify(self, peer: str, payload: bytes, xfer: Transfer) -> None:
        conn = self._conn(peer)
        seq = conn.next_seq()
        conn.submit(PendingOp(seq, Kind.NOTIFY, frame(Kind.NOTIFY, [seq, payload]), xfer))

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        self.server.close()

    def forked(self) -> None:
        for p in self._peers.values():
            for c in p.conns:
                if c is not None:
                    c.sock.close()  # (this process's descriptor only: no shutdown)
        self._peers = {}
        self.server.forked()
