"""What the scheduler-side connector hands the worker-side one each step."""
from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # plain tests and docs without vLLM
    KVConnectorMetadata = object


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request: kvtier hashes and the vLLM block ids they go to / come from."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    is_async: bool = False

    def __post_init__(self) -> None:
        assert len(self.hashes) == len(self.block_ids)


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
