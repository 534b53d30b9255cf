"""Block bytes moved by the transfer layer: the client's Agent reads and writes the daemon's
DRAM arena one-sided, by slot, through whatever backend reaches it (tcp; nixl / ucx where
installed, i.e. RDMA). Frames then carry only the control messages: GET leases slots and
names them, RESERVE hands out slots, COMMIT publishes them, exactly as on the same-host path.

The daemon exports each namespace's arena through its own Agent and hands that agent's
metadata, with a capability (a random key its port demands), only to clients that passed
HELLO's auth for the namespace; the key lives as long as a connection of the client holds it.

Where the bytes land: a tcp transfer of DIRECT_BYTES or more goes straight from or into
the caller's rows (one host array), registered for that call only: for tcp a registration
is bookkeeping (~25 us), where the copy through staging it spares is ~75-165 us a MiB (a
16 x 1 MiB get spent 1.2 of its 5.0 ms in it). Smaller ones, and every transfer of a
backend whose registration pins pages (nixl, ucx: RDMA), go through one staging buffer
registered once, so those calls on one client are serialised here.
"""
from __future__ import annotations

import threading
import uuid
from typing import Sequence

import numpy as np

from kvstore import wire as w
from transfer import Agent, AgentConfig, BackendKind, DescList, Op, TransferError
from transfer.copy import copy_bytes

DIRECT_BYTES = 512 << 10  # tcp transfers this big or bigger skip the staging copy


class AgentPath:
    def __init__(self, info: w.HelloOk, backends: Sequence[BackendKind],
                 timeout_s: float, spin_us: float = 0.0, connect_timeout_s: float = 5.0) -> None:
        """The client's own timeouts bound the agent's: `timeout_s` a transfer's silence,
        `connect_timeout_s` a connection's setup (its HELLO to the daemon's agent)."""
        self.meta, self.access_key = info.agent_meta, info.agent_key
        self.block_bytes, self.timeout_s = info.block_bytes, timeout_s
        self.agent = Agent(f"kvtier-client-{uuid.uuid4().hex[:12]}",
                           AgentConfig(backends=tuple(backends), io_timeout_s=timeout_s,
                                       connect_timeout_s=connect_timeout_s, spin_us=spin_us))
        try:
            self.peer = self.agent.add_peer(info.agent_meta, key=info.agent_key)
            self.remote = self.agent.prepare(
                DescList.uniform(info.agent_region, info.block_bytes, info.shm_slots),
                peer=self.peer)
        except BaseException:
            self.agent.close()
            raise
        self.broken = False
        self._lock = threading.Lock()
        self._staging: np.ndarray | None = None
        self._region = None
        self._local = None

    @property
    def over_tcp(self) -> bool:
        """The daemon's arena is reached through the tcp backend (not RDMA)."""
        return self.remote.backend is BackendKind.TCP

    def _stage(self, n: int) -> np.ndarray:
        """The staging rows for n blocks, registered once and regrown by powers of two."""
        if self._staging is None or len(self._staging) < n:
            if self._region is not None:
                self.agent.deregister(self._region)
            cap = 1 << max(0, (n - 1).bit_length())
            self._staging = np.empty((cap, self.block_bytes), np.uint8)
            self._region = self.agent.register(self._staging, export=False)
            self._local = self.agent.prepare(DescList.uniform(self._region, self.block_bytes, cap))
        return self._staging

    def _move(self, op: Op, slots: Sequence[int], local=None, local_idx=None) -> None:
        """Move the slots' bytes to or from `local` (staging rows 0.. when None)."""
        try:
            self.agent.transfer(op, self._local if local is None else local,
                                np.arange(len(slots)) if local_idx is None else local_idx,
                                self.remote, np.asarray(slots, np.int64), self.timeout_s)
        except TransferError as e:
            self.broken = True  # the daemon restarted or went away: a new HELLO makes a new one
            if local is not None or op is Op.WRITE:  # nothing of a failed transfer may land
                # in the caller's rows after it returns, nor a WRITE still queued (a timeout
                # leaves it pending) reach slots the caller's ABORT gives back: its
                # connections end now
                self.agent.close()
            raise ConnectionError(f"transfer agent {op.name} of {len(slots)} blocks: {e}") from e

    def _direct(self, op: Op, slots: Sequence[int], host: np.ndarray | None,
                idx: Sequence[int] | None) -> bool:
        """`op` straight between the slots and rows `idx` of `host` (the caller's rows as
        one `[n, block_bytes]` host array), when it is a tcp transfer of DIRECT_BYTES or
        more; False: it goes through staging (so does a read-only source, bytes say: the
        agent registers no read-only array)."""
        if (host is None or idx is None or not self.over_tcp or not host.flags.writeable
                or len(slots) * self.block_bytes < DIRECT_BYTES):
            return False
        try:
            region = self.agent.register(host, export=False)
        except TransferError as e:  # closed by another thread's failed transfer
            self.broken = True
            raise ConnectionError(f"transfer agent {op.name}: {e}") from e
        try:
            local = self.agent.prepare(DescList.uniform(region, self.block_bytes, len(host)))
            self._move(op, slots, local, np.asarray(idx, np.int64))
        finally:
            self.agent.deregister(region)
        return True

    def read(self, slots: Sequence[int], dsts: Sequence,
             host: np.ndarray | None = None, idx: Sequence[int] | None = None) -> None:
        """Copy the (leased) arena slots into the destination rows `dsts` (which are rows
        `idx` of `host`, when the caller has them as one host array: see `_direct`)."""
        if not len(slots) or self._direct(Op.READ, slots, host, idx):
            return
        with self._lock:
            staging = self._stage(len(slots))
            self._move(Op.READ, slots)
            for i, dst in enumerate(dsts):
                copy_bytes(dst, staging[i])

    def write(self, slots: Sequence[int], srcs: Sequence,
              host: np.ndarray | None = None, idx: Sequence[int] | None = None) -> None:
        """Copy the source rows `srcs` (rows `idx` of `host`, see `read`) into the
        (reserved) arena slots."""
        if not len(slots) or self._direct(Op.WRITE, slots, host, idx):
            return
        with self._lock:
            staging = self._stage(len(slots))
            for i, src in enumerate(srcs):
                copy_bytes(staging[i], src)
            self._move(Op.WRITE, slots)

    def close(self) -> None:
        self.agent.close()
