"""Block bytes moved by the transfer layer: the client's Agent reads and writes the daemon's
DRAM arena one-sided, by slot, through whatever backend reaches it (tcp; nixl / ucx where
installed, i.e. RDMA). Frames then carry only the control messages: GET leases slots and
names them, RESERVE hands out slots, COMMIT publishes them, exactly as on the same-host path.

The daemon exports each namespace's arena through its own Agent and hands that agent's
metadata, with a capability (a random key its port demands), only to clients that passed
HELLO's auth for the namespace; the key lives as long as a connection of the client holds it. Transfers go through
one registered staging buffer (registering each caller's buffer per call would cost more
than the copy, and a real NIXL registration pins pages), so calls on one client are
serialised here.
"""
from __future__ import annotations

import threading
import uuid
from typing import Sequence

import numpy as np
import torch

from kvstore import wire as w
from transfer import Agent, AgentConfig, BackendKind, DescList, Op, TransferError
from transfer.copy import copy_bytes


class AgentPath:
    def __init__(self, info: w.HelloOk, backends: Sequence[BackendKind],
                 timeout_s: float) -> None:
        self.meta, self.access_key = info.agent_meta, info.agent_key
        self.block_bytes, self.timeout_s = info.block_bytes, timeout_s
        self.agent = Agent(f"kvtier-client-{uuid.uuid4().hex[:12]}",
                           AgentConfig(backends=tuple(backends), io_timeout_s=timeout_s))
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

    def _move(self, op: Op, slots: Sequence[int]) -> None:
        try:
            self.agent.transfer(op, self._local, np.arange(len(slots)), self.remote,
                                np.asarray(slots, np.int64), self.timeout_s)
        except TransferError as e:
            self.broken = True  # the daemon restarted or went away: a new HELLO makes a new one
            raise ConnectionError(f"transfer agent {op.name} of {len(slots)} blocks: {e}") from e

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor]) -> None:
        """Copy the (leased) arena slots into the destination rows."""
        if not len(slots):
            return
        with self._lock:
            staging = self._stage(len(slots))
            self._move(Op.READ, slots)
            for i, dst in enumerate(dsts):
                copy_bytes(dst, staging[i])

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor]) -> None:
        """Copy the source rows into the (reserved) arena slots."""
        if not len(slots):
            return
        with self._lock:
            staging = self._stage(len(slots))
            for i, src in enumerate(srcs):
                copy_bytes(staging[i], src)
            self._move(Op.WRITE, slots)

    def close(self) -> None:
        self.agent.close()
