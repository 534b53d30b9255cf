"""Daemon configuration: one frozen dataclass, declared once.

Each field that a user may set carries its help text (and, where the name differs, its flag)
in the field's metadata: `kvtier serve`'s flags, the TOML config file's `[serve]` keys and
the validation all come from this one declaration (`options()`), so no list of names is
kept anywhere else.
"""
from __future__ import annotations

import hmac
import importlib.util
import ipaddress
import logging
import math
import os
import re
import tomllib
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Iterator, NamedTuple

from kvstore.config import parse_size, read_text_file
from kvstore.errors import ConfigError

log = logging.getLogger("kvtier.serve")

ADMIN = "*"  # the tenant of a token that may use every namespace and the admin endpoints


def opt(default: Any, help: str, *, flag: str | None = None, kind: str = "",
        **kw) -> Any:
    """A user-settable field: `kind` is "size" (bytes, '4GiB' accepted), "list" (comma
    separated, 'none' = empty), "flag" (a store_false switch) or "" (its annotation's type)."""
    meta = {"help": help, "flag": flag, "kind": kind}
    if callable(default):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


class TenantLimits(NamedTuple):
    max_namespaces: int
    memory_bytes: int  # DRAM + GPU bytes all of the tenant's namespaces may hold; 0 = no cap
    disk_bytes: int    # SSD bytes likewise


@dataclass(frozen=True)
class DaemonConfig:
    host: str = opt("127.0.0.1", "bind address (others than loopback need --token-file)")
    port: int = opt(7481, "data-plane port (0 = any free port)")
    http_port: int = opt(7480, "control-plane port (0 = any free port)")
    data_dir: str = opt("./kvtier-data", "SSD tier directory")
    dram_bytes: int = opt(1 << 30, "DRAM tier size per namespace (0 = none)",
                          flag="--dram-size", kind="size")
    ssd_bytes: int = opt(64 << 30, "SSD tier size per namespace (0 = none); grows on "
                         "demand, so an unused size reserves no disk", flag="--ssd-size",
                         kind="size")
    gpu_bytes: int = opt(-1, "GPU tier size per namespace (default 1GiB when CUDA is "
                         "available, else none)", flag="--gpu-size", kind="size")
    gpu_device: str | None = None
    high_watermark: float = opt(0.95, "background eviction starts above this fill fraction")
    low_watermark: float = opt(0.85, "...and stops at this one")
    quota_blocks: int = opt(0, "most blocks a namespace keeps in each tier (0 = no cap "
                            "beyond the tier sizes)")
    tenant_quotas: tuple[tuple[str, int], ...] = ()  # per-tenant quota_blocks ([quotas])
    max_namespaces: int = opt(8, "namespaces one tenant may host at once")
    max_namespaces_total: int = opt(64, "namespaces the daemon hosts at once, all tenants")
    tenant_memory_bytes: int = opt(0, "DRAM + GPU bytes all namespaces of one tenant may "
                                   "hold (0 = no cap)", flag="--tenant-memory", kind="size")
    tenant_disk_bytes: int = opt(0, "SSD bytes all namespaces of one tenant may hold "
                                 "(0 = no cap)", flag="--tenant-disk", kind="size")
    memory_bytes: int = opt(0, "DRAM bytes the DRAM tiers of all namespaces together may "
                            "hold (0 = the memory of the host, or of its cgroup); a "
                            "namespace whose DRAM tier does not fit is refused",
                            flag="--max-memory", kind="size")
    tenant_limits: tuple[tuple[str, int, int, int], ...] = ()  # [tenants.NAME] overrides
    tokens: tuple[tuple[str, str], ...] = ()  # (token, tenant or ADMIN), from --token-file
    scratch_bytes: int = opt(1 << 30, "memory all connections together may use to move "
                             "SSD and GPU blocks in and out (each request's window shrinks "
                             "to fit, down to a block or two)", flag="--scratch-memory",
                             kind="size")
    block_tokens: int = opt(0, "accept only namespaces with this block size in tokens "
                            "(0 = any)")
    max_connections: int = opt(1024, "open data-plane connections at most (a quarter of "
                               "them may be waiting to authenticate)")
    max_tenant_connections: int = opt(0, "authenticated data-plane connections one tenant "
                                      "may hold (0 = three quarters of --max-connections "
                                      "when the token file names two tenants or more, else "
                                      "no cap); admin tokens are not capped")
    hello_timeout_s: float = opt(10.0, "seconds a new connection has to authenticate",
                                 flag="--hello-timeout")
    idle_timeout_s: float = opt(600.0, "seconds an authenticated connection may stay "
                                "silent (or stall mid-frame) before it is closed",
                                flag="--idle-timeout")
    reservation_timeout_s: float = opt(30.0, "seconds a same-host RESERVE may wait for its "
                                       "COMMIT before it is reclaimed (a PUT request holds "
                                       "its slots for as long as it lasts)",
                                       flag="--reservation-timeout")
    spin_us: float = opt(100.0, "microseconds an authenticated connection (the transfer "
                         "agent's too) polls for its next request before it sleeps (0 = "
                         "sleep at once): a request that comes meanwhile is served without "
                         "the CPU's wake-up (tens of us on VMs); adaptive, an idle "
                         "connection soon stops polling, and none polls while the CPUs are "
                         "oversubscribed",
                         flag="--spin-us")
    lease_ttl_s: float = opt(30.0, "seconds a lease on DRAM slots (a same-host or transfer-"
                             "agent read) keeps its blocks from eviction: a client releases "
                             "it with its next request, and one that does not loses it then",
                             flag="--lease-ttl")
    max_payload_bytes: int = 1 << 30
    durable: bool = opt(True, "SSD puts without the write-ahead log (faster; recent blocks "
                        "lost on a crash, never corrupted)", flag="--no-wal", kind="flag")
    local_socket: bool = opt(True, "serve no same-host clients over the local socket "
                             "(shared memory); every client then uses TCP",
                             flag="--no-local-socket", kind="flag")
    inspectable: bool = opt(False, "keep the process dumpable, so debuggers and py-spy of "
                            "the same user can attach (they can then read every tenant's "
                            "memory too)")
    node_id: str = opt(lambda: os.uname().nodename, "this node's name in KV events "
                       "(default the hostname)")
    log_level: str = opt("info", "debug, info, warning or error")
    shutdown_grace_s: float = 10.0
    cluster: str | None = opt(None, "etcd://HOST:PORT[,HOST:PORT]/PREFIX: join a multi-node "
                              "pool coordinated by etcd (etcds://: over TLS, trusting the "
                              "system's CAs unless --etcd-ca-file names one)")
    advertise: str | None = opt(None, "address peers and clients use to reach this node "
                                "(default: the bind address)")
    etcd_credentials_file: str | None = opt(
        None, "file holding USER:PASSWORD for etcd (when its auth is on: `etcdctl auth "
        "enable`); without it anyone who reaches etcd can rewrite the pool's membership")
    etcd_ca_file: str | None = opt(
        None, "PEM file of the CA etcd's certificate chains to: talk to etcd over TLS (etcd "
        "serving https:// client URLs); without TLS the pool's records and the etcd "
        "password cross the network in the clear")
    etcd_cert_file: str | None = opt(
        None, "PEM certificate this node shows etcd, for an etcd started with "
        "--client-cert-auth (with --etcd-key-file)")
    etcd_key_file: str | None = opt(
        None, "PEM private key of --etcd-cert-file (readable by its owner alone)")
    cluster_ttl_s: int = opt(5, "seconds of silence after which etcd drops a node",
                             flag="--cluster-ttl")
    event_interval_s: float = 0.05   # how often KV events are shipped to the leader
    # Transfer-layer backends a namespace's DRAM arena is exported through, for clients on
    # other hosts that move block bytes with a transfer Agent (one-sided READ/WRITE into
    # leased / reserved slots) instead of inline in frames; () = none.
    agent_backends: tuple[str, ...] = opt(("tcp",), "transfer backends each namespace's DRAM "
                                          "arena is exported through for Client(use_agent="
                                          "True): comma-separated of tcp, nixl, ucx, or none",
                                          kind="list")

    def __post_init__(self) -> None:
        self._check_types()
        if self.advertise == "":
            object.__setattr__(self, "advertise", None)  # (an empty variable: the bind address)
        if self.advertise is not None:
            from kvstore.cluster.records import check_host_port
            from kvstore.wire import netloc
            try:  # (one with a port joined as "[127.0.0.1:5555]:7481": every client raised)
                check_host_port(netloc(self.advertise, 1), "--advertise", ("kvtier",))
            except ConfigError:
                raise ConfigError(f"--advertise {self.advertise!r} must be a host name or an "
                                  "address alone, without a port or a scheme (the node "
                                  "advertises its own ports)") from None
        if self.cluster and self.tokens and not self.cluster_token:
            raise ConfigError("--cluster with a --token-file needs an admin token in it (a "
                              "line with no tenant): the nodes report their blocks to the "
                              "leader with it, and without one the pool's index stays empty")
        if not self.tokens and not _is_loopback(self.host):
            raise ConfigError(f"refusing to bind {self.host}: without an auth token the daemon "
                              "only binds loopback (pass --token-file to serve other hosts)")
        if self.dram_bytes <= 0 and self.ssd_bytes <= 0 and self.gpu_bytes <= 0:
            raise ConfigError("at least one tier needs a size (--dram-size / --ssd-size)")
        if self.gpu_bytes > 0 and importlib.util.find_spec("torch") is None:
            raise ConfigError("a GPU tier (--gpu-size) needs torch, which a store-only "
                              "install leaves out: pip install 'kvtier[engine]'")
        if self.max_tenant_connections < 0:
            raise ConfigError("max_tenant_connections must be 0 (the default cap) or more")
        if min(self.max_namespaces, self.max_namespaces_total, self.max_connections) < 1:
            raise ConfigError("max_namespaces, max_namespaces_total and max_connections "
                              "must be >= 1")
        for port in (self.port, self.http_port):
            if not 0 <= port < 65536:
                raise ConfigError(f"port {port} out of range")
        if self.cluster is not None and not self.cluster.startswith(("etcd://", "etcds://")):
            raise ConfigError(f"--cluster {self.cluster!r} must be etcd://HOST:PORT[,...]/PREFIX "
                              "(etcds:// for etcd over TLS)")
        etcd_files = {"--etcd-credentials-file": self.etcd_credentials_file,
                      "--etcd-ca-file": self.etcd_ca_file, "--etcd-cert-file": self.etcd_cert_file,
                      "--etcd-key-file": self.etcd_key_file}
        given = [flag for flag, path in etcd_files.items() if path is not None]
        if given and self.cluster is None:
            raise ConfigError(f"{given[0]} is etcd's: it goes with --cluster")
        if given:  # (refused now, not once the node has opened its ports and tries etcd)
            self.etcd_address()
        for b in self.agent_backends:
            if b not in ("tcp", "nixl", "ucx"):
                raise ConfigError(f"agent backend {b!r} is not one of tcp, nixl, ucx")
        if min(self.reservation_timeout_s, self.lease_ttl_s, self.hello_timeout_s,
               self.idle_timeout_s, self.event_interval_s) <= 0:
            raise ConfigError("timeouts must be > 0")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(f"watermarks must satisfy 0 < low ({self.low_watermark}) <= "
                              f"high ({self.high_watermark}) <= 1")
        if not isinstance(self.log_level, str) or self.log_level.lower() not in (
                "debug", "info", "warning", "error", "critical"):
            raise ConfigError(f"log level {self.log_level!r} is not one of debug, info, "
                              "warning, error, critical")
        if not 0 <= self.spin_us <= 1e6:
            raise ConfigError(f"--spin-us is 0 to 1000000 microseconds, not {self.spin_us}")
        for name in ("quota_blocks", "block_tokens", "tenant_memory_bytes",
                     "tenant_disk_bytes", "shutdown_grace_s", "scratch_bytes",
                     "memory_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 or more, not {getattr(self, name)}")
        if self.cluster_ttl_s < 1 or self.max_payload_bytes < 1:
            raise ConfigError("cluster_ttl_s and max_payload_bytes must be 1 or more")

    def _check_types(self) -> None:
        """Every number a number of its kind, finite (a config file's 'no' for a bool was
        true, '1GiB' for max_payload_bytes stayed a string, --idle-timeout inf failed every
        connection with OverflowError and a NaN timeout with ValueError)."""
        for f in fields(self):
            value = getattr(self, f.name)
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            if kind == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{f.name} must be true or false, not {value!r}")
            if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{f.name} must be a whole number, not {value!r}")
            if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                    or not math.isfinite(value)):
                raise ConfigError(f"{f.name} must be a finite number, not {value!r}")
            # (node_id = 5 started a daemon whose every HELLO reply the clients refused;
            # data_dir = 5 was a TypeError traceback)
            if kind == "str" and not isinstance(value, str):
                raise ConfigError(f"{f.name} must be a string, not {value!r}")
            if kind == "str | None" and value is not None and not isinstance(value, str):
                raise ConfigError(f"{f.name} must be a string, not {value!r}")

    @property
    def timeout_periods(self) -> tuple[float, int]:
        """An authenticated connection's kernel socket timeout and how many of them in a
        row of silence close it: the idle timeout cut into equal periods of at most twice
        the reservation timeout, the most a payload or a reply may then overrun its
        deadline by. A put or a GET then sets no timeout of its own (two setsockopt calls
        each: about 7 us of a 256 KiB TCP put's ~130 us of daemon CPU)."""
        n = max(1, math.ceil(self.idle_timeout_s / (2 * self.reservation_timeout_s)))
        return self.idle_timeout_s / n, n

    @property
    def auth_required(self) -> bool:
        return bool(self.tokens)

    @property
    def tenant_connection_cap(self) -> int:
        """Connections one tenant may hold (0 = no cap): --max-tenant-connections, or by
        default three quarters of --max-connections once two tenants share the daemon, so
        none of them can take every connection from the others."""
        if self.max_tenant_connections:
            return self.max_tenant_connections
        tenants = {t for _, t in self.tokens if t != ADMIN}
        return max(1, self.max_connections * 3 // 4) if len(tenants) >= 2 else 0

    def etcd_address(self):
        """The parsed --cluster address with its credentials and TLS files read
        (ConfigError for a bad one); None without --cluster."""
        if self.cluster is None:
            return None
        from kvstore.cluster.records import parse_etcd_url, read_etcd_tls
        return parse_etcd_url(self.cluster, self.etcd_credentials_file,
                              read_etcd_tls(self.etcd_ca_file, self.etcd_cert_file,
                                            self.etcd_key_file))

    def tenant_of(self, token: str) -> str | None:
        """The tenant a token grants (ADMIN for every tenant), None for a bad token.
        Every configured token is compared (constant time), so timing says nothing."""
        if not self.tokens:
            return ADMIN
        found = None
        given = token.encode("utf-8", "surrogateescape")  # (a header's odd bytes: no 500)
        for known, tenant in self.tokens:
            if hmac.compare_digest(known.encode(), given):
                found = tenant
        return found

    @property
    def cluster_token(self) -> str:
        """The token this node presents to its peers: the first admin token ('' without auth)."""
        return next((tok for tok, tenant in self.tokens if tenant == ADMIN), "")

    def quota_for(self, tenant: str) -> int:
        return dict(self.tenant_quotas).get(tenant, self.quota_blocks)

    def limits_for(self, tenant: str) -> TenantLimits:
        for name, *values in self.tenant_limits:
            if name == tenant:
                return TenantLimits(*values)
        return TenantLimits(self.max_namespaces, self.tenant_memory_bytes,
                            self.tenant_disk_bytes)


def options() -> Iterator[tuple[str, str, dict]]:
    """(field name, flag, metadata) of every user-settable field."""
    for f in fields(DaemonConfig):
        if "help" in f.metadata:
            flag = f.metadata["flag"] or "--" + f.name.removesuffix("_s").replace("_", "-")
            yield f.name, flag, f.metadata


def coerce(name: str, value: Any) -> Any:
    """A value from a flag or the config file, as the field wants it."""
    f = next(f for f in fields(DaemonConfig) if f.name == name)
    kind = f.metadata.get("kind", "")
    if kind == "size":
        return parse_size(value)
    if kind == "list" and isinstance(value, str):
        return () if value in ("", "none") else tuple(v.strip() for v in value.split(","))
    return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: str) -> tuple[tuple[str, str], ...]:
    """Lines `TOKEN` (admin: every tenant) or `TOKEN TENANT` (that tenant only); a `#` at
    the start of a line or after a space starts a comment (one inside a token is part of
    it: cut there, `Xy7#kP2q alice` was the admin token `Xy7`). A token named twice is
    refused (the last line won: a tenant's token became an admin's)."""
    text, mode = read_text_file(path, "token file")
    lines = [_COMMENT.split(ln, 1)[0].split() for ln in text]
    out: list[tuple[str, str]] = []
    for parts in filter(None, lines):
        if len(parts) > 2:
            raise ConfigError(f"token file {path}: a line is `TOKEN [TENANT]`, got {parts}")
        if len(parts) == 2 and parts[1] == ADMIN:  # ADMIN as a tenant would be an admin
            raise ConfigError(f"token file {path}: {ADMIN!r} is not a tenant name (a token "
                              "alone on its line is an admin token)")
        if any(parts[0] == known for known, _ in out):
            raise ConfigError(f"token file {path} names a token twice: each token grants "
                              "one tenant (or, alone on its line, every tenant)")
        out.append((parts[0], parts[1] if len(parts) == 2 else ADMIN))
    if not out:
        raise ConfigError(f"token file {path} holds no token")
    if mode & 0o077:
        log.warning("token file %s can be read by other users (mode %o): chmod 600 it",
                    path, mode & 0o777)
    return tuple(out)


_COMMENT = re.compile(r"(?:^|(?<=\s))#")


def read_toml(path: str) -> dict:
    """The [serve] table of a config file (keys as DaemonConfig fields), [quotas]
    (tenant = blocks per namespace and tier) and [tenants.NAME] tables (max_namespaces,
    memory, disk)."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    known = {name for name, _, _ in options()} | {"token_file", "max_payload_bytes"}
    tables = set(doc) - {"serve", "quotas", "tenants"}
    if tables:  # (a typo such as [tenant.x] dropped its limits without a word)
        raise ConfigError(f"config file {path}: unknown tables {sorted(tables)} (there are "
                          "[serve], [quotas] and [tenants.NAME])")
    serve = doc.get("serve", {})
    if not isinstance(serve, dict):
        raise ConfigError(f"config file {path}: serve must be a [serve] table")
    unknown = set(serve) - known
    if unknown:
        raise ConfigError(f"config file {path}: unknown [serve] keys {sorted(unknown)}")
    try:
        serve = {k: (v if k == "token_file" else parse_size(v) if k == "max_payload_bytes"
                     else coerce(k, v)) for k, v in serve.items()}
        if "quotas" in doc:
            serve["tenant_quotas"] = tuple((str(k), int(v)) for k, v in doc["quotas"].items())
        if "tenants" in doc:
            serve["tenant_limits"] = tuple(_tenant_row(path, k, v)
                                           for k, v in doc["tenants"].items())
    except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong kind
        raise ConfigError(f"config file {path}: {e}") from e
    if "token_file" in serve and not isinstance(serve["token_file"], str):
        raise ConfigError(f"config file {path}: token_file must be a path (a string)")
    return serve


def _tenant_row(path: str, tenant: str, table: Any) -> tuple[str, int, int, int]:
    if not isinstance(table, dict) or set(table) - {"max_namespaces", "memory", "disk"}:
        raise ConfigError(f"config file {path}: [tenants.{tenant}] takes max_namespaces, "
                          "memory and disk")
    return (str(tenant), int(table.get("max_namespaces", DaemonConfig.max_namespaces)),
            parse_size(table.get("memory", 0)), parse_size(table.get("disk", 0)))


def with_overrides(cfg: DaemonConfig, **kw) -> DaemonConfig:
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})


def default_of(name: str) -> Any:
    f = next(f for f in fields(DaemonConfig) if f.name == name)
    return f.default_factory() if f.default is MISSING else f.default


def memory_limit() -> int | None:
    """The most memory this process may use: the host's (MemTotal), or its cgroup's limit
    where that is lower; None where neither can be read."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits) if limits else None
