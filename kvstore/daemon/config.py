"""Daemon configuration: one frozen dataclass, read from flags and an optional TOML file."""
from __future__ import annotations

import hmac
import ipaddress
import os
import tomllib
from dataclasses import dataclass, field, fields, replace

from kvstore.errors import ConfigError

ADMIN = "*"  # the tenant of a token that may use every namespace and the admin endpoints


@dataclass(frozen=True)
class DaemonConfig:
    host: str = "127.0.0.1"
    port: int = 7481                 # data plane (framed binary protocol)
    http_port: int = 7480            # control plane (aiohttp)
    data_dir: str = "./kvtier-data"
    dram_bytes: int = 1 << 30        # per namespace
    ssd_bytes: int = 64 << 30        # per namespace
    gpu_bytes: int = 0               # per namespace; 0 = no GPU tier
    gpu_device: str | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    quota_blocks: int = 0            # most blocks a namespace keeps in each tier; 0 = no cap
    tenant_quotas: tuple[tuple[str, int], ...] = ()
    tokens: tuple[tuple[str, str], ...] = ()  # (token, tenant or ADMIN)
    block_tokens: int = 0            # only namespaces with this block size; 0 = any
    max_namespaces: int = 8
    reservation_timeout_s: float = 30.0
    lease_ttl_s: float = 30.0
    max_payload_bytes: int = 1 << 30
    durable: bool = True
    node_id: str = field(default_factory=lambda: f"{os.uname().nodename}")
    log_level: str = "info"
    shutdown_grace_s: float = 10.0
    cluster: str | None = None       # etcd://HOST:PORT[,HOST:PORT]/PREFIX to join a pool
    advertise: str | None = None     # address other nodes and clients reach this node at
    cluster_ttl_s: int = 5           # etcd lease: a silent node leaves after this long
    event_interval_s: float = 0.05   # how often KV events are shipped to the leader
    # Transfer-layer backends a namespace's DRAM arena is exported through, for clients on
    # other hosts that move block bytes with a transfer Agent (one-sided READ/WRITE into
    # leased / reserved slots) instead of inline in frames; () = none.
    agent_backends: tuple[str, ...] = ("tcp",)

    def __post_init__(self) -> None:
        if not self.tokens and not _is_loopback(self.host):
            raise ConfigError(f"refusing to bind {self.host}: without an auth token the daemon "
                              "only binds loopback (pass --token-file to serve other hosts)")
        if self.dram_bytes <= 0 and self.ssd_bytes <= 0 and self.gpu_bytes <= 0:
            raise ConfigError("at least one tier needs a size (--dram-size / --ssd-size)")
        if self.max_namespaces < 1:
            raise ConfigError("max_namespaces must be >= 1")
        for port in (self.port, self.http_port):
            if not 0 <= port < 65536:
                raise ConfigError(f"port {port} out of range")
        if self.cluster is not None and not self.cluster.startswith("etcd://"):
            raise ConfigError(f"--cluster {self.cluster!r} must be etcd://HOST:PORT[,...]/PREFIX")
        for b in self.agent_backends:
            if b not in ("tcp", "nixl", "ucx"):
                raise ConfigError(f"agent backend {b!r} is not one of tcp, nixl, ucx")
        if self.reservation_timeout_s <= 0 or self.lease_ttl_s <= 0:
            raise ConfigError("reservation and lease timeouts must be > 0")

    @property
    def auth_required(self) -> bool:
        return bool(self.tokens)

    def tenant_of(self, token: str) -> str | None:
        """The tenant a token grants (ADMIN for every tenant), None for a bad token.
        Every configured token is compared (constant time), so timing says nothing."""
        if not self.tokens:
            return ADMIN
        found = None
        for known, tenant in self.tokens:
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        return found

    @property
    def cluster_token(self) -> str:
        """The token this node presents to its peers: the first admin token ('' without auth)."""
        return next((tok for tok, tenant in self.tokens if tenant == ADMIN), "")

    def quota_for(self, tenant: str) -> int:
        return dict(self.tenant_quotas).get(tenant, self.quota_blocks)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: str) -> tuple[tuple[str, str], ...]:
    """Lines `TOKEN` (admin: every tenant) or `TOKEN TENANT` (that tenant only); # comments."""
    try:
        with open(path) as f:
            lines = [ln.split("#", 1)[0].split() for ln in f]
    except OSError as e:
        raise ConfigError(f"cannot read token file {path}: {e}") from e
    out = []
    for parts in filter(None, lines):
        if len(parts) > 2:
            raise ConfigError(f"token file {path}: a line is `TOKEN [TENANT]`, got {parts}")
        out.append((parts[0], parts[1] if len(parts) == 2 else ADMIN))
    if not out:
        raise ConfigError(f"token file {path} holds no token")
    return tuple(out)


def read_toml(path: str) -> dict:
    """The [serve] table of a config file (keys as DaemonConfig fields) plus [quotas]."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    known = {f.name for f in fields(DaemonConfig)}
    serve = dict(doc.get("serve", {}))
    unknown = set(serve) - known - {"token_file"}
    if unknown:
        raise ConfigError(f"config file {path}: unknown [serve] keys {sorted(unknown)}")
    if "quotas" in doc:
        serve["tenant_quotas"] = tuple((str(k), int(v)) for k, v in doc["quotas"].items())
    return serve


def with_overrides(cfg: DaemonConfig, **kw) -> DaemonConfig:
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})
