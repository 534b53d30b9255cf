"""kvtier.transfer — a small NIXL-shaped data-movement library (the bottom layer of kvtier).

Lifecycle: register memory once, exchange metadata once, prepare descriptor lists once, then
on the hot path post READ/WRITE transfers by index arrays and poll/wait/release the handles.

    import numpy as np
    from transfer import Agent, AgentConfig, DescList, Op, ShmSegment

    store = Agent("store")                          # backends local, shm, tcp by default
    arena = ShmSegment.create(64 << 20)             # same-host peers map it (pre-faulted)
    slab = store.register(arena)                    # -> Region (region_id, size, kind)

    worker = Agent("decode-0")
    staging = worker.register(np.empty(64 << 20, np.uint8))
    peer = worker.add_peer(store.metadata())        # msgpack bytes, sent any way you like
    store.add_peer(worker.metadata())               # (only needed to notify back / be read)

    BLOCK = 1 << 20
    local = worker.prepare(DescList.uniform(staging, BLOCK, 64))          # once
    remote = worker.prepare(DescList.uniform(slab.region_id, BLOCK, 64), peer=peer)  # once;
                                                    # picks local → shm → tcp for this peer
    xfer = worker.post(Op.READ, local, np.arange(8), remote, np.array([5, 9, 2, 0, 1, 3, 4, 7]),
                       notify=b"fetched")           # 8 blocks in one post
    xfer.wait(timeout=5.0)                          # or poll() -> State.PENDING / State.DONE
    xfer.release()
    store.notifications()                           # [Notification(peer="decode-0", payload=b"fetched")]

Public API
- `Agent(name, config=AgentConfig())`: `register(memory, export=True) -> Region` for a numpy
  array, torch tensor (CPU or device), `ShmSegment`, `FileRegion` or writable buffer;
  `deregister(region)`; `metadata() -> bytes`; `add_peer(bytes) -> name`; `remove_peer`;
  `peer_regions(name)`; `prepare(DescList, peer=None, backend=None) -> Prepared`;
  `post(Op, local, local_idx, remote, remote_idx, notify=None) -> Transfer`;
  `transfer(Op, local, local_idx, remote, remote_idx, timeout=None)` (post, wait and
  release in one call, for a caller that would wait anyway: tcp then runs it on the
  calling thread when its connection is idle);
  `send_notification(peer, bytes) -> Transfer`; `notifications(timeout=0) -> [Notification]`;
  `close()` (also a context manager).
- `DescList(region_ids, offsets, lengths)` (numpy int64 arrays), `.from_tuples`, `.uniform`.
  Remote lists use the peer's region ids (from `peer_regions` / its metadata).
- `Transfer`: `poll()`, `wait(timeout)`, `release()`, `state`, `name`, `nbytes`.
  DONE means every byte landed (and the peer has the notification, if one was attached).
- `TransferError(fault: Fault, cause, transfer)`: every failure — bad descriptors
  (OUT_OF_RANGE), unregistered/unexported memory (UNREGISTERED), UNKNOWN_PEER, PEER_GONE,
  CONNECTION_LOST, PROTOCOL (malformed frame), TIMEOUT, CLOSED. `post` raises what it can
  check at once; later failures are raised by `poll()`/`wait()`. Never a hang: socket waits
  are bounded by `AgentConfig.io_timeout_s`.
- Backends (`BackendKind`): LOCAL (same process: direct copies, torch for device memory),
  SHM (same host: copies between pre-faulted mappings of the peer's shm/file regions; its
  notifications ride the tcp control path), TCP (any host: msgpack headers, raw payloads via
  sendmsg / recvmsg_into straight into registered memory, pipelined, `tcp_num_conns` per
  peer). Optional adapters, used only when named in `AgentConfig.backends` (never by
  default) and importable: NIXL (`nixl-cu12`, one-sided over its UCX plugin) and UCX
  (`ucxx-cu13`, tag messages). Both listen on every network interface: run them in a
  loopback-only `unshare -n` namespace or on a trusted network. Peers can only reach
  exported regions.
- Threading: post/poll/wait may be called from several threads. Transfers over local/shm
  complete inside `post`; tcp transfers complete on background threads (or on the caller's,
  through `transfer`).
"""
from .agent import Agent
from .descriptors import DescList, Prepared
from .errors import Fault, TransferError
from .handle import Transfer
from .memory import FileRegion, Region
from .metadata import AgentMetadata, RegionInfo
from .shm import ShmSegment
from .types import AgentConfig, BackendKind, MemKind, Notification, Op, State

__all__ = ["Agent", "AgentConfig", "AgentMetadata", "BackendKind", "DescList", "Fault",
           "FileRegion", "MemKind", "Notification", "Op", "Prepared", "Region", "RegionInfo",
           "ShmSegment", "State", "Transfer", "TransferError"]
