"""Per-namespace stores: created on a client's first hello, reopened from disk at start.

A namespace is one model's KV layout plus a tenant (`kvstore.keys.Namespace`); each gets its
own TieredStore (its own DRAM arena in /dev/shm and RocksDB directory under the data dir),
so its block size is fixed and one tenant's blocks are never reachable from another's.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from kvstore.config import StoreConfig, TierConfig
from kvstore.daemon.config import ADMIN, DaemonConfig
from kvstore.errors import ConfigError
from kvstore.events import TierKind
from kvstore.keys import Namespace
from kvstore.store import TieredStore
from kvstore.wire import ErrorCode, Hello, RemoteError
from transfer import Agent, AgentConfig, BackendKind

NS_FILE = "namespace.json"


class ShmInfo(NamedTuple):
    path: str
    dev: int
    ino: int
    num_slots: int
    directory: str  # the arena's slot directory (kvstore.tiers.slotdir)


class AgentInfo(NamedTuple):
    agent: Agent       # exports this namespace's DRAM arena (and nothing else)
    metadata: bytes    # what a client's Agent needs (handed out after HELLO's auth)
    region_id: int     # the arena's region: slot i is bytes [i * block_bytes, +block_bytes)


@dataclass
class Hosted:
    ns: Namespace
    store: TieredStore
    shm: ShmInfo | None
    quota_blocks: int
    agent: AgentInfo | None = None
    # Of the store's hits, those served from leased DRAM slots (shm and zero-copy TCP
    # reads): how much traffic skips a copy through the daemon.
    lease_hits: int = 0
    # Of the store's hits, those a same-host client copied from published DRAM slots with
    # no request at all (reported afterwards in TOUCH batches).
    direct_hits: int = 0
    _count_lock: threading.Lock = field(default_factory=threading.Lock)

    def count_lease_hits(self, n: int) -> None:
        with self._count_lock:
            self.lease_hits += n

    def count_direct_hits(self, n: int) -> None:
        with self._count_lock:
            self.direct_hits += n

    @property
    def label(self) -> str:
        return f"{self.ns.model}@{self.ns.tenant}" if self.ns.tenant else self.ns.model


def namespace_of(hello: Hello) -> Namespace:
    try:
        return Namespace(hello.model, hello.num_layers, hello.num_kv_heads, hello.head_dim,
                         hello.dtype, hello.block_tokens, hello.revision, hello.tenant)
    except ValueError as e:
        raise RemoteError(ErrorCode.NAMESPACE, str(e)) from e


class Registry:
    def __init__(self, cfg: DaemonConfig, shm_tag: str) -> None:
        self.cfg, self.shm_tag = cfg, shm_tag  # shm_tag: the data port, unique on the host
        self._lock = threading.Lock()
        self._hosted: dict[int, Hosted] = {}
        self._closed = False

    def open(self, ns: Namespace, tenant_grant: str) -> Hosted:
        """The store of `ns`, created on first use; checks the tenant grant and the limits."""
        if tenant_grant != ADMIN and ns.tenant != tenant_grant:
            raise RemoteError(ErrorCode.FORBIDDEN, f"this token is for tenant {tenant_grant!r}, "
                              f"not {ns.tenant!r}")
        if self.cfg.block_tokens and ns.block_tokens != self.cfg.block_tokens:
            raise RemoteError(ErrorCode.NAMESPACE, f"this daemon serves blocks of "
                              f"{self.cfg.block_tokens} tokens, not {ns.block_tokens}")
        with self._lock:
            if self._closed:
                raise RemoteError(ErrorCode.UNAVAILABLE, "the daemon is shutting down")
            hosted = self._hosted.get(ns.ns_id)
            if hosted is None:
                if len(self._hosted) >= self.cfg.max_namespaces:
                    raise RemoteError(ErrorCode.NAMESPACE, f"the daemon already hosts "
                                      f"{len(self._hosted)} namespaces (--max-namespaces)")
                hosted = self._hosted[ns.ns_id] = self._create(ns)
            return hosted

    def _create(self, ns: Namespace) -> Hosted:
        directory = self._dir(ns)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, NS_FILE), "w") as f:
            json.dump(asdict(ns), f)
        quota = self.cfg.quota_for(ns.tenant)
        shm_name = f"kvtier-{self.shm_tag}-{ns.ns_id:016x}"
        _unlink_stale(shm_name)  # we hold the port: no live daemon owns this name
        tiers = _tiers(self.cfg, ns, quota, directory, shm_name)
        store = TieredStore(ns, StoreConfig(tiers, reservation_timeout_s=self.cfg.reservation_timeout_s,
                                            node_id=self.cfg.node_id, background_interval_s=0.5))
        shm = None
        if TierKind.DRAM in store.tier_kinds:
            path = os.path.join("/dev/shm", shm_name)
            st = os.stat(path)
            dram = store.tier(TierKind.DRAM)
            shm = ShmInfo(path, st.st_dev, st.st_ino, dram.num_slots, dram.directory.path)
        return Hosted(ns, store, shm, quota, agent=self._export(ns, store))

    def _export(self, ns: Namespace, store: TieredStore) -> AgentInfo | None:
        """One transfer Agent per namespace, so its metadata (its random agent id is what
        lets a peer in) only ever reaches clients authenticated for this namespace."""
        if not self.cfg.agent_backends or TierKind.DRAM not in store.tier_kinds:
            return None
        kinds = tuple(BackendKind(b) for b in self.cfg.agent_backends)
        agent = Agent(f"kvtier-{self.cfg.node_id}-{ns.ns_id:016x}",
                      AgentConfig(backends=kinds, tcp_host=self.cfg.host))
        try:
            region = agent.register(store.tier(TierKind.DRAM).arena)
            return AgentInfo(agent, agent.metadata(), region.region_id)
        except BaseException:
            agent.close()
            raise

    def reopen_existing(self) -> int:
        """Open every namespace found under the data dir (so its SSD blocks are served)."""
        if not os.path.isdir(self.cfg.data_dir):
            return 0
        count = 0
        for name in sorted(os.listdir(self.cfg.data_dir)):
            meta = os.path.join(self.cfg.data_dir, name, NS_FILE)
            if os.path.isfile(meta) and len(self._hosted) < self.cfg.max_namespaces:
                with open(meta) as f:
                    self.open(Namespace(**json.load(f)), ADMIN)
                count += 1
        return count

    def hosted(self, tenant_grant: str = ADMIN) -> list[Hosted]:
        with self._lock:
            return [h for h in self._hosted.values()
                    if tenant_grant == ADMIN or h.ns.tenant == tenant_grant]

    def find(self, ns_id: int, tenant_grant: str) -> Hosted | None:
        return next((h for h in self.hosted(tenant_grant) if h.ns.ns_id == ns_id), None)

    def _dir(self, ns: Namespace) -> str:
        return os.path.join(self.cfg.data_dir, f"{ns.ns_id:016x}")

    def clear(self, hosted: Hosted) -> None:
        """Drop a namespace's blocks on every tier; the next hello starts it empty.
        Connections still using it get an UNAVAILABLE error and reconnect."""
        with self._lock:
            if self._hosted.get(hosted.ns.ns_id) is not hosted:
                return
            del self._hosted[hosted.ns.ns_id]
        _close_agent(hosted)
        hosted.store.close(flush=False)
        shutil.rmtree(self._dir(hosted.ns), ignore_errors=True)

    def close(self) -> None:
        """Close every store with flush: memory-tier blocks go to SSD for the next start."""
        with self._lock:
            self._closed = True
            hosted, self._hosted = list(self._hosted.values()), {}
        for h in hosted:
            _close_agent(h)
            h.store.close(flush=True)


def _close_agent(hosted: Hosted) -> None:
    if hosted.agent is not None:
        hosted.agent.agent.close()


def _tiers(cfg: DaemonConfig, ns: Namespace, quota: int, directory: str,
           shm_name: str) -> tuple[TierConfig, ...]:
    bb = ns.block_bytes
    marks = dict(high_watermark=cfg.high_watermark, low_watermark=cfg.low_watermark)

    def cap(nbytes: int) -> int:
        n = nbytes // bb
        return min(n, quota) if quota else n

    tiers = []
    if cap(cfg.gpu_bytes) > 0:
        tiers.append(TierConfig(TierKind.GPU, cap(cfg.gpu_bytes), device=cfg.gpu_device, **marks))
    if cap(cfg.dram_bytes) > 0:
        tiers.append(TierConfig(TierKind.DRAM, cap(cfg.dram_bytes), shm_name=shm_name, **marks))
    if cap(cfg.ssd_bytes) > 0:
        tiers.append(TierConfig(TierKind.SSD, cap(cfg.ssd_bytes), path=os.path.join(directory, "ssd"),
                                durable=cfg.durable, **marks))
    if not tiers:
        raise RemoteError(ErrorCode.NAMESPACE, f"blocks of {bb} bytes do not fit any tier "
                          "(raise --dram-size / --ssd-size)")
    return tuple(tiers)


def _unlink_stale(shm_name: str) -> None:
    try:
        os.unlink(os.path.join("/dev/shm", shm_name))
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot remove stale shared memory /dev/shm/{shm_name}: {e}") from e
