"""The placement contract: what a policy sees, what it returns, and the shared estimates.

A policy is given one request and a `ClusterView` (load of every prefill and decode instance
plus the cluster block index) and returns a `Placement`. Policies keep no state about the
cluster beyond what the view says (round-robin keeps its counter, random its generator), so
the same policy object drives the live scheduler and the simulator.
"""
from __future__ import annotations

import abc
import math
import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvstore.index import PrefixMatch
from kvstore.scheduler.cost_model import CostModel, llama2_70b_like


class PolicyKind(enum.Enum):
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX = "prefix"
    CONDUCTOR = "conductor"


class RejectReason(enum.Enum):
    TTFT_SLO = "ttft_slo"  # the best prefill estimate misses the TTFT SLO
    TBT_SLO = "tbt_slo"  # every decode instance would step slower than the TBT SLO
    NO_INSTANCE = "no_instance"  # the view has no prefill or no decode instance


@dataclass(frozen=True)
class RouteRequest:
    """One inference request as the scheduler sees it. `block_hashes` name its full prompt
    blocks in order, each chained on everything before it."""

    request_id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[Hashable, ...]

    def __post_init__(self) -> None:
        if self.input_tokens <= 0:
            raise ValueError(f"RouteRequest.input_tokens must be > 0, got {self.input_tokens}")
        if self.output_tokens < 0:
            raise ValueError(f"RouteRequest.output_tokens must be >= 0, got {self.output_tokens}")
        if not 0 <= self.arrival_s < math.inf:  # (NaN and inf too: the simulator's clock)
            raise ValueError(f"RouteRequest.arrival_s must be finite and >= 0, got "
                             f"{self.arrival_s}")


@dataclass(frozen=True)
class SchedulerConfig:
    cost: CostModel = llama2_70b_like()
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    # Fetch a prefix from another node only when it is at least this many times longer
    # than the local one (Mooncake's kvcache_balancing_threshold); the fetched blocks stay
    # on the chosen node, which replicates a hot prefix.
    balancing_threshold: float = 1.25
    early_reject: bool = False

    def __post_init__(self) -> None:
        if not (0 < self.ttft_slo_s < math.inf and 0 < self.tbt_slo_s < math.inf):
            raise ValueError("SchedulerConfig SLOs must be finite and > 0 (a NaN SLO met no "
                             "request, and goodput read 0)")
        if self.balancing_threshold < 1.0:
            raise ValueError(f"balancing_threshold must be >= 1, got {self.balancing_threshold}")


class PrefillLoad(NamedTuple):
    node_id: str
    queue_s: float  # seconds of work already queued ahead of a new request


class DecodeLoad(NamedTuple):
    node_id: str
    batch_size: int  # sequences running or admitted
    kv_tokens: int  # KV tokens those sequences hold
    kv_capacity_tokens: int


class BlockLocator(Protocol):
    def query(self, hashes: Sequence[Hashable]) -> PrefixMatch: ...


@dataclass(frozen=True)
class ClusterView:
    prefill: tuple[PrefillLoad, ...]
    decode: tuple[DecodeLoad, ...]
    index: BlockLocator
    # Nodes that can hand blocks to a prefill instance (a pool); None: any node in the index.
    # A node not listed still counts for its own local prefix.
    sources: frozenset[str] | None = None


class Placement(NamedTuple):
    """Where a request goes. `cached_blocks` leading blocks are already on the prefill node,
    the next `fetch_blocks` come from `fetch_node`; the rest are computed."""

    prefill_node: str | None
    decode_node: str | None
    cached_blocks: int = 0
    fetch_node: str | None = None
    fetch_blocks: int = 0
    estimated_ttft_s: float = 0.0
    estimated_tbt_s: float = 0.0
    reject: RejectReason | None = None


class Policy(Protocol):
    """Chooses a prefill and a decode instance for each request. Side effects: only the
    policy's own counter or random generator advances; the view is never changed."""

    kind: PolicyKind

    def place(self, request: RouteRequest, view: ClusterView) -> Placement: ...


# ---- shared estimates ------------------------------------------------------------------
def cached_tokens(request: RouteRequest, blocks: int, block_tokens: int) -> int:
    """Prompt tokens covered by `blocks` leading blocks, leaving at least one to compute."""
    return min(blocks * block_tokens, request.input_tokens - 1)


def prefill_estimate_s(request: RouteRequest, blocks: int, cost: CostModel) -> float:
    """Prefill seconds for `request` with `blocks` leading blocks already available."""
    cached = cached_tokens(request, blocks, cost.block_tokens)
    return cost.prefill.time_s(request.input_tokens - cached, cached)


def decode_estimate_s(request: RouteRequest, load: DecodeLoad, cost: CostModel) -> float:
    """Decode step seconds on `load` once `request` joins its batch."""
    kv = load.kv_tokens + request.input_tokens + request.output_tokens
    return cost.decode.step_s(load.batch_size + 1, kv)


def choose_decode(request: RouteRequest, view: ClusterView, cost: CostModel) -> tuple[str, float]:
    """The decode instance with the fastest step once `request` joins, among those with KV
    room for it; when none has room, the one with the most free KV (the request waits).
    Equal estimates go to the less loaded (fewer sequences, then less KV): a cost model
    fitted to a busy host's noisy timings can come out flat (no per-sequence or per-token
    term), and the name alone then sent every request to the same instance."""
    need = request.input_tokens + request.output_tokens
    fits = [d for d in view.decode if d.kv_tokens + need <= d.kv_capacity_tokens]
    if fits:
        best = min(fits, key=lambda d: (decode_estimate_s(request, d, cost), d.batch_size,
                                        d.kv_tokens, d.node_id))
    else:
        best = max(view.decode, key=lambda d: (d.kv_capacity_tokens - d.kv_tokens, d.node_id))
    return best.node_id, decode_estimate_s(request, best, cost)


def no_instance(view: ClusterView) -> Placement | None:
    """A rejection when the view lacks prefill or decode instances, else None."""
    if view.prefill and view.decode:
        return None
    return Placement(None, None, reject=RejectReason.NO_INSTANCE)


class PolicyBase(abc.ABC):
    """Shared shape of the built-in policies: a config, and a placement that first rejects
    a view without instances, then asks the policy's own `choose`."""

    kind: PolicyKind

    def __init__(self, config: SchedulerConfig, seed: int = 0) -> None:
        self.config = config

    def place(self, request: RouteRequest, view: ClusterView) -> Placement:
        return no_instance(view) or self.choose(request, view)

    @abc.abstractmethod
    def choose(self, request: RouteRequest, view: ClusterView) -> Placement:
        """Placement on a view that has prefill and decode instances."""
