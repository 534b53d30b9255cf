"""`nixl`: an optional adapter over real NIXL (`nixl-cu12`, its UCX plugin); one-sided RDMA-style
READ/WRITE straight between registered buffers, NIXL notifications after the data.

Imported only when an agent names `BackendKind.NIXL` in `AgentConfig.backends`. UCX inside
NIXL listens on every network interface: run it only where that is acceptable (the tests and
the bench run it inside `unshare -n` with loopback alone).

What NIXL does not give us, this adapter adds with small control notifications (prefix byte
`C`; user payloads travel with prefix `U`):
- revocation: `deregister` tells every known peer the region is gone and waits (bounded) for
  its ack, so a peer's later post fails UNREGISTERED instead of writing into freed memory;
- departure: `close` tells known peers, whose later posts fail PEER_GONE.
A peer that never `add_peer`-ed this agent cannot be told; it keeps NIXL's stale view.
"""
from __future__ import annotations

import importlib
import threading
import time

import msgpack
import numpy as np

from ..errors import Fault, TransferError
from ..handle import Transfer
from ..memory import Region
from ..metadata import AgentMetadata
from ..types import BackendKind, Notification
from .base import AgentContext, Job, quiet_ucx_without_rdma


def _import_nixl():
    """The NIXL python API: the `nixl` meta package if present, else a CUDA variant."""
    errors = []
    for name in ("nixl", "nixl_cu12", "nixl_cu13"):
        try:
            mod = importlib.import_module(name)
            return mod.nixl_agent, mod.nixl_agent_config
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError("NIXL python API not importable (" + "; ".join(errors) + ")")


quiet_ucx_without_rdma()
nixl_agent, nixl_agent_config = _import_nixl()

USER, CTRL, ACK = b"U", b"C", b"A"
_VRAM = 1
IDLE_POLL_S = 0.002  # how often an idle agent looks for notifications
BUSY_POLL_S = 0.00005
ACK_WAIT_S = 5.0  # bound on waiting for peers to acknowledge a revocation or a departure
# (a live peer that has not acked by then keeps its stale view: its next post may still land
# in what was deregistered, or reach a closed agent; 2 s ran out once on a loaded CI host,
# and a peer's write to an agent closed meanwhile went through)


def _addr(region: Region) -> tuple[int, int, int]:
    """(address, memory type, device id) of a registered region."""
    if region.host is not None:
        return region.host.__array_interface__["data"][0], 0, 0
    return region.device.data_ptr(), _VRAM, max(region.device.get_device(), 0)


class _Peer:
    def __init__(self, meta: AgentMetadata, nixl_name: str, regions: dict):
        self.meta = meta
        self.nixl_name = nixl_name
        self.base = np.full(max(regions, default=0) + 1, -1, np.int64)  # region id → address
        self.mem = np.zeros(self.base.size, np.int64)
        self.dev = np.zeros(self.base.size, np.int64)
        for rid, (addr, mem, dev) in regions.items():
            self.base[rid], self.mem[rid], self.dev[rid] = addr, mem, dev
        self.revoked: set[int] = set()
        self.gone = False


class NixlBackend:
    kind = BackendKind.NIXL

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.nixl_name = f"{ctx.name}.{ctx.agent_id}"
        self.nixl = nixl_agent(self.nixl_name, nixl_agent_config(backends=["UCX"]))
        self._regs: dict[int, tuple[object, tuple[int, int, int]]] = {}
        self._peers: dict[str, _Peer] = {}  # our peer name → peer
        self._by_nixl: dict[str, str] = {}  # NIXL agent name → our peer name
        self._pending: list[tuple[object, Transfer, float]] = []
        self._acks: dict[bytes, threading.Event] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._poller = threading.Thread(target=self._poll_loop, daemon=True,
                                        name=f"nixl-{ctx.name}")
        self._poller.start()

    # registration and metadata --------------------------------------------------------------

    def metadata_fields(self) -> dict:
        exported = {r.region_id for r in self.ctx.regions.exported()}
        regions = [[rid, *info] for rid, (_, info) in self._regs.items() if rid in exported]
        blob = msgpack.packb([self.nixl_name, self.nixl.get_agent_metadata(), regions],
                             use_bin_type=True)
        return {"nixl": blob}

    def on_register(self, region: Region) -> None:
        addr, mem, dev = _addr(region)
        try:
            reg = self.nixl.register_memory([(addr, region.size, dev, "")],
                                            "VRAM" if mem == _VRAM else "DRAM")
        except Exception as e:  # NIXL raises its own nixlBind errors
            raise TransferError(Fault.INVALID, f"NIXL cannot register region: {e}") from e
        self._regs[region.region_id] = (reg, (addr, mem, dev))

    def on_deregister(self, region: Region) -> None:
        entry = self._regs.pop(region.region_id, None)
        if entry is None:
            return
        if region.exported:
            self._broadcast(["revoke", region.region_id])
        self.nixl.deregister_memory(entry[0])

    # peers ----------------------------------------------------------------------------------

    def add_peer(self, peer: AgentMetadata) -> None:
        if peer.nixl is None:
            self.remove_peer(peer.name)
            return
        try:
            name, md, regions = msgpack.unpackb(peer.nixl, raw=False)
            table = {int(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in regions}
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as e:
            raise TransferError(Fault.PROTOCOL, f"malformed nixl metadata: {e}") from e
        old = self._peers.get(peer.name)
        if old is not None and old.nixl_name != name:
            self.remove_peer(peer.name)
        try:
            self.nixl.add_remote_agent(md)  # a reload refreshes the peer's registrations
        except Exception as e:
            raise TransferError(Fault.PROTOCOL, f"NIXL refused peer metadata: {e}") from e
        with self._lock:
            self._peers[peer.name] = _Peer(peer, name, table)
            self._by_nixl[name] = peer.name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
            if peer is not None:
                self._by_nixl.pop(peer.nixl_name, None)
        if peer is not None:
            try:
                self.nixl.remove_remote_agent(peer.nixl_name)
            except Exception:
                pass  # already invalidated on NIXL's side; nothing left to undo

    def reaches(self, peer: AgentMetadata, remote_ids: np.ndarray) -> bool:
        p = self._peers.get(peer.name)
        if p is None or p.meta.agent_id != peer.agent_id:
            return False
        ids = np.unique(remote_ids)
        ids = ids[ids < p.base.size]
        return bool((p.base[ids] >= 0).all()) and len(set(p.mem[ids].tolist())) <= 1

    def _peer(self, name: str) -> _Peer:
        p = self._peers.get(name)
        if p is None:
            raise TransferError(Fault.UNKNOWN_PEER, f"peer {name!r} is not reachable by nixl")
        if p.gone:
            raise TransferError(Fault.PEER_GONE, f"peer {name!r} has closed")
        return p

    # transfers ------------------------------------------------------------------------------

    def _descs(self, job: Job, p: _Peer) -> tuple[np.ndarray, str, np.ndarray, str]:
        ids = np.unique(job.local_ids).tolist()
        base = {i: self._regs[i][1] for i in ids if i in self._regs}
        if len(base) != len(ids):
            raise TransferError(Fault.UNREGISTERED, "a local region is not registered")
        if len({b[1] for b in base.values()}) > 1:
            raise TransferError(Fault.UNSUPPORTED, "nixl: one transfer mixes DRAM and VRAM")
        lut = np.zeros(max(ids) + 1, np.int64)
        devs = np.zeros_like(lut)
        for i, (addr, _, dev) in base.items():
            lut[i], devs[i] = addr, dev
        local = np.stack([lut[job.local_ids] + job.local_offsets, job.lengths,
                          devs[job.local_ids]], axis=1).astype(np.uint64)
        remote = np.stack([p.base[job.remote_ids] + job.remote_offsets, job.lengths,
                           p.dev[job.remote_ids]], axis=1).astype(np.uint64)
        mem = next(iter(base.values()))[1]
        rmem = int(p.mem[job.remote_ids[0]])
        return local, "VRAM" if mem == _VRAM else "DRAM", remote, \
            "VRAM" if rmem == _VRAM else "DRAM"

    def post(self, xfer: Transfer, job: Job) -> None:
        p = self._peer(job.peer)
        if p.revoked and p.revoked.intersection(np.unique(job.remote_ids).tolist()):
            raise TransferError(Fault.UNREGISTERED, f"peer {job.peer!r} deregistered a region "
                                "this transfer addresses")
        local, lmem, remote, rmem = self._descs(job, p)
        try:
            handle = self.nixl.initialize_xfer(
                job.op.name, self.nixl.get_xfer_descs(local, lmem),
                self.nixl.get_xfer_descs(remote, rmem), p.nixl_name,
                USER + job.notify if job.notify is not None else b"")
            state = self.nixl.transfer(handle)
        except Exception as e:
            raise TransferError(Fault.REMOTE, f"NIXL refused the transfer: {e}") from e
        if state == "DONE":
            handle.release()
            xfer._done_part()
        elif state == "ERR":
            handle.release()
            raise TransferError(Fault.CONNECTION_LOST, "NIXL failed to post the transfer")
        else:
            with self._lock:
                self._pending.append((handle, xfer, time.monotonic() + self.ctx.config.io_timeout_s))
            self._wake.set()

    def notify(self, peer: str, payload: bytes, xfer: Transfer) -> None:
        p = self._peer(peer)
        self._send(p.nixl_name, USER + payload)
        xfer._done_part()

    def _send(self, nixl_name: str, msg: bytes) -> None:
        try:
            self.nixl.send_notif(nixl_name, msg)
        except Exception as e:
            raise TransferError(Fault.CONNECTION_LOST, f"NIXL notification failed: {e}") from e

    # control messages -----------------------------------------------------------------------

    def _broadcast(self, msg: list) -> None:
        """Send a control message to every known peer; wait (bounded) for their acks."""
        waits = []
        for p in list(self._peers.values()):
            if p.gone:
                continue
            token = f"{self.ctx.agent_id}/{time.monotonic_ns()}/{p.nixl_name}".encode()
            event = self._acks[token] = threading.Event()
            try:
                self._send(p.nixl_name, CTRL + msgpack.packb([token, *msg], use_bin_type=True))
                waits.append((token, event))
            except TransferError:
                self._acks.pop(token, None)
        deadline = time.monotonic() + min(ACK_WAIT_S, self.ctx.config.io_timeout_s)
        for token, event in waits:
            event.wait(max(0.0, deadline - time.monotonic()))
            self._acks.pop(token, None)

    def _on_control(self, sender: str, body: bytes) -> None:
        token, op, *args = msgpack.unpackb(body, raw=False)
        peer = self._peers.get(self._by_nixl.get(sender, ""))
        if peer is not None:
            if op == "revoke":
                peer.revoked.add(int(args[0]))
            elif op == "bye":
                peer.gone = True
                self._fail_peer(peer.meta.name)
        try:
            self._send(sender, ACK + token)
        except TransferError:
            pass  # the sender's bounded wait covers a lost ack

    def _fail_peer(self, name: str) -> None:
        with self._lock:
            failing = [e for e in self._pending if e[1].peer == name]
            self._pending = [e for e in self._pending if e[1].peer != name]
        for _, xfer, _ in failing:
            xfer._fail(TransferError(Fault.PEER_GONE, f"peer {name!r} closed mid-transfer"))

    # progress -------------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        while not self._closed:
            busy = self._check_pending()
            self._check_notifs()
            if busy:
                time.sleep(BUSY_POLL_S)
            else:
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()

    def _check_pending(self) -> bool:
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return False
        now, finished = time.monotonic(), []
        for entry in pending:
            handle, xfer, deadline = entry
            state = self.nixl.check_xfer_state(handle)
            if state == "PROC" and now < deadline:
                continue
            finished.append(entry)
            if state == "DONE":
                handle.release()
                xfer._done_part()
            elif state == "ERR":
                xfer._fail(TransferError(Fault.CONNECTION_LOST, "NIXL reported an error"))
            else:
                xfer._fail(TransferError(Fault.CONNECTION_LOST, "no completion within "
                                         f"io_timeout_s={self.ctx.config.io_timeout_s}"))
        with self._lock:
            self._pending = [e for e in self._pending if e not in finished]
        return True

    def _check_notifs(self) -> None:
        for sender, msgs in self.nixl.get_new_notifs().items():
            for msg in msgs:
                kind, body = msg[:1], msg[1:]
                if kind == USER:
                    self.ctx.deliver(Notification(sender.rsplit(".", 1)[0], body))
                elif kind == ACK:
                    event = self._acks.get(body)
                    if event is not None:
                        event.set()
                elif kind == CTRL:
                    self._on_control(sender, body)

    def close(self) -> None:
        if self._closed:
            return
        self._broadcast(["bye"])  # acked, so the message left before NIXL is torn down
        self._closed = True
        self._wake.set()
        self._poller.join(timeout=5)
        with self._lock:
            pending, self._pending = self._pending, []
        for _, xfer, _ in pending:
            xfer._fail(TransferError(Fault.CLOSED, "agent closed with the transfer pending"))
        for name in list(self._peers):
            self.remove_peer(name)
        for reg, _ in self._regs.values():
            self.nixl.deregister_memory(reg)
        self._regs.clear()
