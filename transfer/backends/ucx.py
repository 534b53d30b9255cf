"""`ucx`: an optional adapter over UCX through `ucxx` (`ucxx-cu13`). UCXX's python API has tag
messaging but no one-sided memory access, so READ/WRITE are a small two-sided protocol: the
initiator sends a header (msgpack) to the peer's worker, the payload moves as tagged messages
straight between registered buffers (UCX picks shared memory / CMA / tcp underneath), and the
peer answers with a status. The peer validates every descriptor against what it exports at
that moment, so deregistration is honoured without any cache to invalidate.

Imported only when an agent names `BackendKind.UCX`. UCX listens on every network interface:
run it only where that is acceptable (tests and bench run it inside `unshare -n`).
"""
from __future__ import annotations

import abc
import itertools
import os
import struct
import threading
import time

from .base import quiet_ucx_without_rdma  # noqa: E402

quiet_ucx_without_rdma()
try:  # the libucx wheel's loader makes libucp findable; ucxx itself skips it without librmm
    import libucx
    libucx.load_library()
except ImportError:
    pass
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
from ucxx._lib import libucxx as ucx  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

from ..errors import Fault, TransferError  # noqa: E402
from ..handle import Transfer  # noqa: E402
from ..memory import Region, check_ranges, finish_staged, host_views  # noqa: E402
from ..metadata import AgentMetadata  # noqa: E402
from ..types import BackendKind, Notification, Op  # noqa: E402
from .base import AgentContext, Job  # noqa: E402

REQ_TAG = 1  # every header goes to the peer's worker under this tag
HEADER_BYTES = 256 << 10
REPLY_BYTES = 4096
MAX_DESCS = 4096  # per header; bigger jobs are split into parts
LEN = struct.Struct("<I")
NOTIFY = 3
BUSY_POLL_S, IDLE_POLL_S, IDLE_AFTER_S = 0.00005, 0.001, 0.01


def _pack(obj, size: int) -> np.ndarray:
    body = msgpack.packb(obj, use_bin_type=True)
    if LEN.size + len(body) > size:
        raise TransferError(Fault.INVALID, f"ucx header of {len(body)} bytes is too large")
    return np.frombuffer(LEN.pack(len(body)) + body, np.uint8).copy()


def _unpack(buf: np.ndarray):
    (n,) = LEN.unpack_from(buf)
    return msgpack.unpackb(buf[LEN.size:LEN.size + n].tobytes(), raw=False)


def _done(reqs) -> bool:
    for r in reqs:
        if not r.completed:
            return False
        r.check_error()
    return True


class _Op(abc.ABC):
    """One in-flight exchange, advanced by the poller; `step()` → True when finished."""

    deadline = 0.0

    @abc.abstractmethod
    def step(self) -> bool:
        """Advance; True once the exchange is finished."""

    def fail(self, err: TransferError) -> None:
        pass


class _ClientOp(_Op):
    def __init__(self, backend, xfer: Transfer, kind: int, ep, reply_tag: int, data_tag: int,
                 views: list, finish: list, sends: list):
        self.b, self.xfer, self.kind, self.ep = backend, xfer, kind, ep
        self.data_tag, self.views, self.finish = data_tag, views, finish
        self.reply = np.zeros(REPLY_BYTES, np.uint8)
        self.ack = np.zeros(REPLY_BYTES, np.uint8)
        self.reply_tag = reply_tag
        self.reply_req = ep.tag_recv(Array(self.reply), ucx.UCXXTag(reply_tag),
                                     ucx.UCXXTagMaskFull)
        self.sends, self.recvs = sends, None

    def step(self) -> bool:
        if self.recvs is None:
            if not _done([self.reply_req]):
                return False
            status, cause = _unpack(self.reply)
            if status != "ok":
                if not _done(self.sends):  # the peer drains what we sent; wait for it
                    return False
                self.xfer._fail(TransferError(Fault(status), f"peer: {cause}"))
                return True
            self.recvs = [self.ep.tag_recv(Array(v), ucx.UCXXTag(self.data_tag),
                                           ucx.UCXXTagMaskFull)
                          for v in (self.views if self.kind == Op.READ else ())]
            if self.kind == Op.READ:  # the target's "sent and notified" reply (same tag)
                self.recvs.append(self.ep.tag_recv(Array(self.ack), ucx.UCXXTag(self.reply_tag),
                                                   ucx.UCXXTagMaskFull))
        if not (_done(self.sends) and _done(self.recvs)):
            return False
        finish_staged(self.finish)
        self.xfer._done_part()
        return True

    def fail(self, err: TransferError) -> None:
        self.xfer._fail(err)


class _ServerOp(_Op):
    def __init__(self, backend, reqs: list, then: list, finish: list, keep=None):
        self.b, self.reqs, self.then, self.finish = backend, reqs, then, finish
        self.keep = keep  # buffers UCX still reads or fills

    def step(self) -> bool:
        if not _done(self.reqs):
            return False
        finish_staged(self.finish)
        for action in self.then:
            action()
        return True


class UcxBackend:
    kind = BackendKind.UCX

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self.worker = ucx.UCXWorker(self.context)
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
        self.address = self.worker.address.tobytes()
        self._client_id = int.from_bytes(os.urandom(4), "little") | 1
        self._seq = itertools.count(1)
        self._peers: dict[str, AgentMetadata] = {}
        self._eps: dict[str, object] = {}  # agent_id → endpoint (both directions)
        self._ops: list[_Op] = []
        self._replies: list = []  # (request, buffer) of replies UCX may still be sending
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._post_header_recv()
        self._poller = threading.Thread(target=self._poll_loop, daemon=True,
                                        name=f"ucx-{ctx.name}")
        self._poller.start()

    def metadata_fields(self) -> dict:
        return {"ucx": msgpack.packb([self.address], use_bin_type=True)}

    def on_register(self, region: Region) -> None:
        pass  # the peer checks its live region table on every request

    def on_deregister(self, region: Region) -> None:
        pass

    def add_peer(self, peer: AgentMetadata) -> None:
        old = self._peers.get(peer.name)
        if old is not None and old.agent_id != peer.agent_id:
            self.remove_peer(peer.name)
        if peer.ucx is not None:
            self._peers[peer.name] = peer

    def remove_peer(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is not None:
            ep = self._eps.pop(peer.agent_id, None)
            if ep is not None:
                ep.close()

    def reaches(self, peer: AgentMetadata, remote_ids: np.ndarray) -> bool:
        p = self._peers.get(peer.name)
        return p is not None and p.agent_id == peer.agent_id

    def _ep(self, agent_id: str, address: bytes):
        ep = self._eps.get(agent_id)
        if ep is None:
            try:
                ep = self.worker.create_endpoint_from_worker_address(
                    ucx.UCXAddress.create_from_buffer(address), True)
            except Exception as e:
                raise TransferError(Fault.PEER_GONE, f"cannot reach ucx peer: {e}") from e
            self._eps[agent_id] = ep
        return ep

    def _peer_ep(self, name: str):
        p = self._peers.get(name)
        if p is None:
            raise TransferError(Fault.UNKNOWN_PEER, f"peer {name!r} is not reachable by ucx")
        ep = self._ep(p.agent_id, msgpack.unpackb(p.ucx, raw=False)[0])
        if not ep.alive:
            self._eps.pop(p.agent_id, None)
            raise TransferError(Fault.PEER_GONE, f"ucx endpoint to {name!r} is closed")
        return ep

    # initiator ------------------------------------------------------------------------------

    def post(self, xfer: Transfer, job: Job) -> None:
        ep = self._peer_ep(job.peer)
        parts = [slice(i, i + MAX_DESCS) for i in range(0, job.lengths.size, MAX_DESCS)]
        xfer._set_parts(len(parts))
        for n, sel in enumerate(parts):
            last = n == len(parts) - 1
            try:
                self._start(xfer, int(job.op), ep, job.remote_ids[sel], job.remote_offsets[sel],
                            job.lengths[sel], job.notify if last else None,
                            *host_views(job.local_regions, job.local_ids[sel],
                                        job.local_offsets[sel], job.lengths[sel],
                                        job.op is Op.READ))
            except BaseException:
                xfer._unstarted(len(parts) - n - 1)  # (this part: the agent's _fail)
                raise

    def notify(self, peer: str, payload: bytes, xfer: Transfer) -> None:
        empty = np.empty(0, np.int64)
        self._start(xfer, NOTIFY, self._peer_ep(peer), empty, empty, empty, payload, [], [])

    def _start(self, xfer, kind, ep, ids, offs, lens, notify, views, finish) -> None:
        seq = next(self._seq) & 0x3FFFFFFF
        reply_tag = (self._client_id << 32) | (seq << 1)
        data_tag = reply_tag | 1
        header = _pack([kind, reply_tag, data_tag, self.ctx.agent_id, self.ctx.name,
                        self.address, ids.astype("<i8").tobytes(),
                        offs.astype("<i8").tobytes(), lens.astype("<i8").tobytes(), notify],
                       HEADER_BYTES)
        op = _ClientOp(self, xfer, kind, ep, reply_tag, data_tag, views, finish, [])
        op.keep = header  # UCX reads it after this returns
        try:
            op.sends.append(ep.tag_send(Array(header), ucx.UCXXTag(REQ_TAG)))
            if kind == Op.WRITE:
                op.sends += [ep.tag_send(Array(v), ucx.UCXXTag(data_tag)) for v in views]
        except Exception as e:
            raise TransferError(Fault.CONNECTION_LOST, f"ucx send failed: {e}") from e
        self._add(op)

    # target ---------------------------------------------------------------------------------

    def _post_header_recv(self) -> None:
        buf = np.zeros(HEADER_BYTES, np.uint8)
        req = self.worker.tag_recv(Array(buf), ucx.UCXXTag(REQ_TAG), ucx.UCXXTagMaskFull)
        self._header = (buf, req)

    def _serve_headers(self) -> bool:
        served = False
        while self._header[1].completed:
            buf, req = self._header
            self._post_header_recv()
            try:
                req.check_error()
                self._serve(_unpack(buf))
            except Exception:  # a malformed or failed header concerns one request only
                pass
            served = True
        return served

    def _serve(self, header: list) -> None:
        kind, reply_tag, data_tag, peer_id, peer_name, address, ids, offs, lens, notify = header
        ep = self._ep(peer_id, address)
        ids, offs, lens = (np.frombuffer(x, "<i8").astype(np.int64) for x in (ids, offs, lens))
        note = [] if notify is None else [
            lambda: self.ctx.deliver(Notification(peer_name, notify))]
        status = ["ok", ""]
        try:
            check_ranges(self.ctx.regions.exported_sizes, ids, offs, lens)
            regions = {i: self.ctx.regions.get(i) for i in np.unique(ids).tolist()}
        except TransferError as e:
            status = [e.fault.value, e.cause]
        reply = _pack(status, REPLY_BYTES)

        def send_reply():
            self._replies.append((ep.tag_send(Array(reply), ucx.UCXXTag(reply_tag)), reply))
        tag = ucx.UCXXTag(data_tag)
        if kind == Op.WRITE:
            if status[0] == "ok":
                views, finish = host_views(regions, ids, offs, lens, incoming=True)
            else:  # drain the payload the initiator already sent, touching nothing
                views, finish = [np.empty(int(n), np.uint8) for n in lens.tolist()], []
            reqs = [ep.tag_recv(Array(v), tag, ucx.UCXXTagMaskFull) for v in views]
            self._add(_ServerOp(self, reqs, (note if status[0] == "ok" else []) + [send_reply],
                                finish, views))
        elif kind == Op.READ and status[0] == "ok":
            views, _ = host_views(regions, ids, offs, lens, incoming=False)
            send_reply()  # the status first: the initiator posts its receives on it
            reqs = [ep.tag_send(Array(v), tag) for v in views]
            # then, once the data is out and the notification delivered, a second reply on
            # the same tag: the initiator's DONE waits for it, so a later bare notification
            # can't overtake this one
            self._add(_ServerOp(self, reqs, note + [send_reply], [], (views, reply)))
        else:
            for action in (note if status[0] == "ok" else []):
                action()
            send_reply()

    # progress -------------------------------------------------------------------------------

    def _add(self, op: _Op) -> None:
        op.deadline = time.monotonic() + self.ctx.config.io_timeout_s
        with self._lock:
            self._ops.append(op)
        self._wake.set()

    def _poll_loop(self) -> None:
        last_busy = time.monotonic()
        while not self._closed:
            busy = self._serve_headers() | self._advance()
            if self._replies:
                self._replies = [(r, b) for r, b in self._replies if not r.completed]
            now = time.monotonic()
            if busy:
                last_busy = now
            if now - last_busy < IDLE_AFTER_S:
                time.sleep(BUSY_POLL_S)
            else:
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()

    def _advance(self) -> bool:
        with self._lock:
            ops = list(self._ops)
        if not ops:
            return False
        now, finished = time.monotonic(), []
        for op in ops:
            try:
                if op.step():
                    finished.append(op)
                elif now > op.deadline:
                    op.fail(TransferError(Fault.CONNECTION_LOST, "no completion within "
                                          f"io_timeout_s={self.ctx.config.io_timeout_s}"))
                    finished.append(op)
            except TransferError as e:
                op.fail(e)
                finished.append(op)
            except Exception as e:  # UCX errors: endpoint closed, peer reset, canceled
                op.fail(TransferError(Fault.CONNECTION_LOST, f"ucx: {e}"))
                finished.append(op)
        with self._lock:
            self._ops = [op for op in self._ops if op not in finished]
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._poller.join(timeout=5)
        with self._lock:
            ops, self._ops = self._ops, []
        for op in ops:
            op.fail(TransferError(Fault.CLOSED, "agent closed with the transfer pending"))
        for ep in self._eps.values():
            try:
                ep.close()
            except Exception:
                pass
        self._eps.clear()
        self._peers.clear()
        self.worker.stop_progress_thread()
