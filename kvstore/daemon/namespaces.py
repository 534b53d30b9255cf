"""Per-namespace stores: created on a client's first hello, reopened from disk at start.

A namespace is one model's KV layout plus a tenant (`kvstore.keys.Namespace`); each gets its
own TieredStore (its own anonymous DRAM arena, its own SSD directory under the data dir), so
its block size is fixed and one tenant's blocks are never reachable from another's.

Limits are per tenant (how many namespaces, how many bytes of memory and of disk their
tiers may take), so one tenant cannot starve the others, plus a cap for the whole daemon.
A namespace that cannot be created leaves nothing on disk; one found on disk at start that
cannot be opened is logged, counted and left where it is, and the daemon serves the rest.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import threading
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from kvstore.config import StoreConfig, TierConfig
from kvstore.daemon.config import ADMIN, DaemonConfig, memory_limit
from kvstore.errors import ConfigError
from kvstore.events import EventRing, KVEvent, TierKind
from kvstore.keys import Namespace
from kvstore.store import TieredStore
from kvstore.wire import ErrorCode, Hello, RemoteError
from transfer import Agent, AgentConfig, BackendKind

log = logging.getLogger("kvtier.namespaces")
NS_FILE = "namespace.json"
MEMORY_TIERS = (TierKind.GPU, TierKind.DRAM)


class AgentInfo(NamedTuple):
    agent: Agent       # exports this namespace's DRAM arena (and nothing else)
    metadata: bytes    # what a client's Agent needs (handed out after HELLO's auth)
    region_id: int     # the arena's region: slot i is bytes [i * block_bytes, +block_bytes)


@dataclass
class Hosted:
    ns: Namespace
    store: TieredStore
    quota_blocks: int
    tier_bytes: dict[TierKind, int]  # capacity of each tier, in bytes (the tenant's quota)
    agent: AgentInfo | None = None
    # Of the store's hits, those served from leased DRAM slots (shm and zero-copy TCP
    # reads): how much traffic skips a copy through the daemon.
    lease_hits: int = 0
    # Of the store's hits, those a same-host client copied from published DRAM slots with
    # no request at all (reported afterwards in TOUCH batches).
    direct_hits: int = 0
    put_channels: int = 0  # open put channels (kvstore.daemon.putchannel): they share grants
    _count_lock: threading.Lock = field(default_factory=threading.Lock)
    # agent capabilities handed out, and how many live connections hold each
    _agent_keys: dict[bytes, int] = field(default_factory=dict)

    # The store's events, drained into one ring every reader shares (the cluster shipper,
    # GET /kv/events): each keeps its own "after seq N" cursor.
    _events: EventRing = field(default_factory=EventRing)
    _events_lock: threading.Lock = field(default_factory=threading.Lock)
    block_bytes: int = field(init=False)  # ns.block_bytes, read by every request
    # Requests (and put-channel drains) using the store right now: a clear waits for them
    # before it closes the store and unmaps its arena. It closed them under running
    # requests: replies sent from unmapped memory (EFAULT), views of a released arena.
    _users: int = 0
    _retired: bool = False
    # `enter` and `leave` take the lock alone, a C-level `with` (one over the Condition, its
    # Python __enter__ and __exit__, took 0.80 us warm against 0.33); `retire` waits on it
    _users_lock: threading.Lock = field(default_factory=threading.Lock)
    _users_cv: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.block_bytes = self.ns.block_bytes
        self._users_cv = threading.Condition(self._users_lock)

    def enter(self) -> bool:
        """A request starts using the store; False when it is being cleared (the caller
        answers UNAVAILABLE, touching nothing). Each True is paired with `leave`."""
        with self._users_lock:
            if self._retired:
                return False
            self._users += 1
            return True

    def leave(self) -> None:
        with self._users_lock:
            self._users -= 1
            if not self._users and self._retired:  # (only `retire` waits: a notify_all
                self._users_cv.notify_all()  # per request was ~1-2 us of Python)

    def retire(self) -> None:
        """No request may start any more; returns once none is running."""
        with self._users_cv:
            self._retired = True
            self._users_cv.wait_for(lambda: not self._users)

    def events_after(self, after: int) -> tuple[KVEvent, ...] | None:
        """The store's events numbered after `after`, or None when some of them are gone
        (the reader takes a `snapshot` instead)."""
        with self._events_lock:
            self._events.extend(self.store.drain_events())
            return self._events.after(after)

    def snapshot(self) -> tuple[int, dict[TierKind, list[bytes]]]:
        """The store's content as of its last event (`TieredStore.snapshot`). Its events are
        drained into the ring first, so other readers' cursors stay valid; only events the
        store dropped meanwhile empty the ring (a reader behind them snapshots too)."""
        with self._events_lock:
            self._events.extend(self.store.drain_events())
            seq, blocks = self.store.snapshot()
            if self._events.next_seq != seq + 1:
                self._events.reset(seq + 1)
            return seq, blocks

    def count_lease_hits(self, n: int) -> None:
        with self._count_lock:
            self.lease_hits += n

    def count_direct_hits(self, n: int) -> None:
        with self._count_lock:
            self.direct_hits += n

    @property
    def label(self) -> str:
        """The namespace's metrics label: model[@tenant]/ns_id (the id keeps apart two
        namespaces of one model that differ in shape, dtype, revision or codec, whose
        samples were otherwise duplicates in one family)."""
        name = f"{self.ns.model}@{self.ns.tenant}" if self.ns.tenant else self.ns.model
        return f"{name}/{self.ns.ns_id:016x}"

    @property
    def dram(self):
        """The DRAM tier (its arena is what same-host clients map), or None."""
        kinds = self.store.tier_kinds
        return self.store.tier(TierKind.DRAM) if TierKind.DRAM in kinds else None

    def agent_key(self, held: bytes = b"") -> bytes:
        """A capability for this namespace's transfer agent: `held` again when it is live
        (a client's further connections share one key), else a fresh one."""
        assert self.agent is not None
        with self._count_lock:
            if held and held in self._agent_keys:
                self._agent_keys[held] += 1
                return held
            key = secrets.token_bytes(32)
            self.agent.agent.grant(key)
            self._agent_keys[key] = 1
            return key

    def drop_agent_key(self, key: bytes) -> None:
        """One connection holding `key` closed; the last one revokes it (and the agent
        closes the transfer connections that used it)."""
        with self._count_lock:
            left = self._agent_keys.get(key, 0) - 1
            if left > 0:
                self._agent_keys[key] = left
                return
            self._agent_keys.pop(key, None)
        if self.agent is not None:
            self.agent.agent.revoke(key)


def namespace_of(hello: Hello) -> Namespace:
    try:
        return Namespace(hello.model, hello.num_layers, hello.num_kv_heads, hello.head_dim,
                         hello.dtype, hello.block_tokens, hello.revision, hello.tenant,
                         hello.codec)
    except ValueError as e:
        raise RemoteError(ErrorCode.NAMESPACE, str(e)) from e


def claim_data_dir(path: str) -> int:
    """Check that `path` is a writable directory no other daemon serves, and hold an flock
    on the directory itself (nothing is created in it) until the returned descriptor is
    closed (the kernel drops it when the process dies, even by SIGKILL). ConfigError, saying
    what to do, otherwise: a daemon that started anyway answered "unavailable, retry later"
    for every namespace."""
    what = f"the data dir {path!r}"
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)  # (one that exists is left as it is)
        if not os.access(path, os.W_OK):  # a read-only filesystem or directory
            raise PermissionError(f"{path} is not writable")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:  # a regular file there, a dangling symlink, a read-only filesystem
        raise ConfigError(f"{what} cannot be used ({e}): pass a writable directory as "
                          "--data-dir") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"another kvtier serve is using {what} ({e}): stop it, or give "
                          "this one its own --data-dir") from e
    return fd


class Registry:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self._dir_lock = claim_data_dir(cfg.data_dir)
        self._lock = threading.Lock()
        # held while a namespace's store is made (its arena faulted in: ~0.5 s a GiB), so
        # that one is made at a time, each within the limits the others left; `_lock` is
        # taken only around looking and adding (held while making, it stopped every
        # tenant's HELLO and the HTTP routes that list namespaces)
        self._making = threading.Lock()
        self._hosted: dict[int, Hosted] = {}
        self._clearing: set[int] = set()  # namespaces whose files `clear` is deleting
        self._closed = False
        # what all DRAM tiers together may hold (each is faulted in when its namespace
        # opens): 8 namespaces of one tenant's token held 8 GiB at the defaults, and a few
        # tenants more than the host had
        self.memory_budget = cfg.memory_bytes or memory_limit()
        self.failed: dict[str, str] = {}  # namespace directories that did not open: why

    def open(self, ns: Namespace, tenant_grant: str) -> Hosted:
        """The store of `ns`, created on first use; checks the tenant grant and the limits."""
        if tenant_grant != ADMIN and ns.tenant != tenant_grant:
            raise RemoteError(ErrorCode.FORBIDDEN, f"this token is for tenant {tenant_grant!r}, "
                              f"not {ns.tenant!r}")
        if self.cfg.block_tokens and ns.block_tokens != self.cfg.block_tokens:
            raise RemoteError(ErrorCode.NAMESPACE, f"this daemon serves blocks of "
                              f"{self.cfg.block_tokens} tokens, not {ns.block_tokens}")
        with self._lock:
            hosted = self._hosted_now(ns)
        if hosted is not None:
            return hosted
        with self._making:
            with self._lock:
                hosted = self._hosted_now(ns)  # (made meanwhile by another HELLO)
                if hosted is not None:
                    return hosted
                tiers = self._plan(ns)
            hosted = self._create(ns, tiers)
            with self._lock:
                if not self._closed:
                    self._hosted[ns.ns_id] = hosted
                    return hosted
            # shutdown began while it was made (close() waits for `_making`, so this store
            # is closed before the data dir is let go)
            _close_agent(hosted)
            hosted.store.close(flush=False)
            raise RemoteError(ErrorCode.UNAVAILABLE, "the daemon is shutting down")

    def _hosted_now(self, ns: Namespace) -> Hosted | None:
        """Under the lock: `ns`'s store if it is made, None if not (UNAVAILABLE while the
        daemon shuts down or the namespace's files are being deleted)."""
        if self._closed:
            raise RemoteError(ErrorCode.UNAVAILABLE, "the daemon is shutting down")
        if ns.ns_id in self._clearing:  # its files are being deleted: a store made now
            raise RemoteError(ErrorCode.UNAVAILABLE, "this namespace is being cleared; "
                              "retry in a moment")  # would lose them mid-way
        hosted = self._hosted.get(ns.ns_id)
        if hosted is not None and hosted.ns != ns:  # two namespaces under one 64-bit id (a
            # crafted one: the tenant check above was of the namespace asked for, not of
            # this store's)
            raise RemoteError(ErrorCode.NAMESPACE, f"namespace id {ns.ns_id:#x} is "
                              "taken by another namespace on this daemon")
        return hosted

    def _plan(self, ns: Namespace) -> tuple[TierConfig, ...]:
        """The tiers a new namespace gets within the daemon's and its tenant's limits."""
        cfg, limits = self.cfg, self.cfg.limits_for(ns.tenant)
        if len(self._hosted) >= cfg.max_namespaces_total:
            raise RemoteError(ErrorCode.QUOTA, f"the daemon already hosts {len(self._hosted)} "
                              "namespaces (--max-namespaces-total)")
        mine = [h for h in self._hosted.values() if h.ns.tenant == ns.tenant]
        if len(mine) >= limits.max_namespaces:
            raise RemoteError(ErrorCode.QUOTA, f"tenant {ns.tenant!r} already has {len(mine)} "
                              "namespaces (--max-namespaces, or [tenants] in the config)")
        used_memory = sum(h.tier_bytes.get(k, 0) for h in mine for k in MEMORY_TIERS)
        used_disk = sum(h.tier_bytes.get(TierKind.SSD, 0) for h in mine)
        memory_left = limits.memory_bytes - used_memory if limits.memory_bytes else None
        disk_left = limits.disk_bytes - used_disk if limits.disk_bytes else None
        tiers = _tiers(cfg, ns, cfg.quota_for(ns.tenant), self._dir(ns), memory_left, disk_left)
        self._check_host_memory(ns, tiers)
        return tiers

    def _check_host_memory(self, ns: Namespace, tiers: tuple[TierConfig, ...]) -> None:
        """Refuse a namespace whose DRAM tier would take the DRAM tiers of all past
        `memory_budget` (QUOTA, naming what holds the memory)."""
        want = sum(t.capacity_blocks * ns.block_bytes for t in tiers if t.kind is TierKind.DRAM)
        if not want or not self.memory_budget:
            return
        held = sum(h.tier_bytes.get(TierKind.DRAM, 0) for h in self._hosted.values())
        if held + want > self.memory_budget:
            raise RemoteError(ErrorCode.QUOTA, f"no memory for this namespace's DRAM tier "
                              f"({want / 2**20:.0f} MiB): the DRAM tiers of the "
                              f"{len(self._hosted)} namespaces hosted hold "
                              f"{held / 2**20:.0f} MiB of the {self.memory_budget / 2**20:.0f} "
                              "MiB this daemon may use (--max-memory, else the host's); clear "
                              "a namespace, or start the daemon with a smaller --dram-size")

    def _create(self, ns: Namespace, tiers: tuple[TierConfig, ...]) -> Hosted:
        directory = self._dir(ns)
        existed = os.path.isdir(directory)
        store = agent = None
        try:
            _private_dir(directory)
            _write_meta(directory, ns)
            store = TieredStore(ns, StoreConfig(tiers, reservation_timeout_s=self.cfg.reservation_timeout_s,
                                                node_id=self.cfg.node_id, background_interval_s=0.5))
            agent = self._export(ns, store)
        except BaseException as e:
            if store is not None:
                store.close(flush=False)
            if not existed:  # a namespace that never came to be leaves nothing behind
                shutil.rmtree(directory, ignore_errors=True)
            if isinstance(e, Exception) and not isinstance(e, RemoteError):
                log.error("cannot open namespace %016x: %s", ns.ns_id, e)
                raise RemoteError(ErrorCode.UNAVAILABLE, f"the daemon could not open this "
                                  f"namespace's store ({e}); retry later") from e
            raise
        sizes = {t.kind: t.capacity_blocks * ns.block_bytes for t in tiers}
        return Hosted(ns, store, self.cfg.quota_for(ns.tenant), sizes, agent=agent)

    def _export(self, ns: Namespace, store: TieredStore) -> AgentInfo | None:
        """One transfer Agent per namespace: only peers holding a key this daemon granted
        to an authenticated client of the namespace get through its port."""
        if not self.cfg.agent_backends or TierKind.DRAM not in store.tier_kinds:
            return None
        kinds = tuple(BackendKind(b) for b in self.cfg.agent_backends)
        # No notifications (nothing here reads them: each peer's 4096 of 64 KiB were kept,
        # 256 MiB per namespace), and no request bigger than a data-plane reply
        agent = Agent(f"kvtier-{self.cfg.node_id}-{ns.ns_id:016x}",
                      AgentConfig(backends=kinds, tcp_host=self.cfg.host, require_grant=True,
                                  spin_us=self.cfg.spin_us, max_note_bytes=0,
                                  max_pending_notes=0,
                                  max_frame_bytes=self.cfg.max_payload_bytes))
        try:
            region = agent.register(store.tier(TierKind.DRAM).arena)
            return AgentInfo(agent, agent.metadata(), region.region_id)
        except BaseException:
            agent.close()
            raise

    def reopen_existing(self) -> int:
        """Open every namespace found under the data dir (so its SSD blocks are served).
        One that fails is logged, counted (`failed`) and left on disk untouched."""
        if not os.path.isdir(self.cfg.data_dir):
            return 0
        count = 0
        for name in sorted(os.listdir(self.cfg.data_dir)):
            meta = os.path.join(self.cfg.data_dir, name, NS_FILE)
            if not os.path.isfile(meta):
                continue
            try:
                with open(meta) as f:
                    self.open(Namespace(**json.load(f)), ADMIN)
                count += 1
            except Exception as e:  # noqa: BLE001 - any reason at all: serve the others
                self.failed[name] = str(e)
                log.error("namespace %s under %s was not opened and is not served (its files "
                          "are left as they are): %s", name, self.cfg.data_dir, e)
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
        ns_id = hosted.ns.ns_id
        with self._lock:
            if self._hosted.get(ns_id) is not hosted or ns_id in self._clearing:
                return
            del self._hosted[ns_id]
            self._clearing.add(ns_id)  # no HELLO opens it again until its files are gone
        try:
            hosted.retire()  # (data-plane requests end by their deadlines, put-channel
            # drains are short: this returns)
            _close_agent(hosted)
            hosted.store.close(flush=False)
            shutil.rmtree(self._dir(hosted.ns), ignore_errors=True)
        finally:
            with self._lock:
                self._clearing.discard(ns_id)

    def close(self) -> None:
        """Close every store with flush: memory-tier blocks go to SSD for the next start."""
        with self._lock:
            self._closed = True  # (a HELLO making a store now closes it when done)
        with self._making, self._lock:  # (that store's files are written by then)
            hosted, self._hosted = list(self._hosted.values()), {}
        try:
            for h in hosted:
                _close_agent(h)
                h.store.close(flush=True)
        finally:
            if self._dir_lock >= 0:
                os.close(self._dir_lock)  # another daemon may take the directory now
                self._dir_lock = -1


def _private_dir(directory: str) -> None:
    """A namespace's directory, readable by the daemon's uid alone: its RocksDB index (the
    hashes of every block it holds: which prompts were seen) and its metadata files were
    made by the umask, 0644, under a directory any uid could list. One made by an older
    version is closed now."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.stat(directory).st_mode & 0o077:
        os.chmod(directory, 0o700)


def _write_meta(directory: str, ns: Namespace) -> None:
    """namespace.json, written only when it differs: rewritten at every open, it was the
    first thing to fail on a full disk, and a restart then served none of the blocks."""
    text = json.dumps(asdict(ns))
    try:
        with open(os.path.join(directory, NS_FILE)) as f:
            if f.read() == text:
                return
    except (OSError, UnicodeDecodeError):
        pass  # absent or unreadable: written afresh
    tmp = os.path.join(directory, NS_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(directory, NS_FILE))


def _close_agent(hosted: Hosted) -> None:
    if hosted.agent is not None:
        hosted.agent.agent.close()


def _tiers(cfg: DaemonConfig, ns: Namespace, quota: int, directory: str,
           memory_left: int | None, disk_left: int | None) -> tuple[TierConfig, ...]:
    """The namespace's tiers: configured sizes, capped by the per-namespace block quota and
    by what the tenant has left of its memory (GPU first, then DRAM) and disk budgets."""
    bb = ns.block_bytes
    marks = dict(high_watermark=cfg.high_watermark, low_watermark=cfg.low_watermark)

    def blocks(nbytes: int, left: int | None) -> int:
        n = max(nbytes, 0) // bb
        if left is not None:
            n = min(n, max(left, 0) // bb)
        return min(n, quota) if quota else n

    tiers = []
    gpu = blocks(cfg.gpu_bytes, memory_left)
    if gpu > 0:
        tiers.append(TierConfig(TierKind.GPU, gpu, device=cfg.gpu_device, **marks))
        memory_left = None if memory_left is None else memory_left - gpu * bb
    dram = blocks(cfg.dram_bytes, memory_left)
    if dram > 0:
        tiers.append(TierConfig(TierKind.DRAM, dram, **marks))
    ssd = blocks(cfg.ssd_bytes, disk_left)
    if ssd > 0:
        tiers.append(TierConfig(TierKind.SSD, ssd, path=os.path.join(directory, "ssd"),
                                durable=cfg.durable, **marks))
    if not tiers:
        if memory_left is not None or disk_left is not None:
            raise RemoteError(ErrorCode.QUOTA, f"tenant {ns.tenant!r} has no room left for a "
                              f"namespace of {bb}-byte blocks (its memory/disk quota is used)")
        raise RemoteError(ErrorCode.NAMESPACE, f"blocks of {bb} bytes do not fit any tier "
                          "(raise --dram-size / --ssd-size)")
    return tuple(tiers)
