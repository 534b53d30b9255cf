"""What every engine plugin shares: how a plugin opens its store.

A plugin talks to kvtier through `kvstore.api.BlockStore` (batched put_n / get_n /
contains_n / match_prefix), so an in-process `TieredStore`, a `kvstore.Client` of a
`kvtier serve` daemon or a `ClusterClient` of a pool plug in alike. Which one is chosen by
`StoreSpec`: `url` for a daemon or pool (`kvstore.connect`), else `path` for a local store
directory (DRAM tier + SSD tier under it).

Block hashes are always computed by kvtier (`kvstore.keys.hash_blocks`) from the token ids,
never taken from the engine, so they agree across processes, restarts and engines.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore import env
from kvstore.api import BlockStore
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace

# What a store that cannot answer raises (a daemon gone, hung or closed: the SDK's
# ConnectError and RequestTimeout, a closed store's error). A plugin then loads nothing and
# saves nothing, and its engine computes, as the engine's own connector does: an outage of
# the KV tier never fails a request.
STORE_OUTAGES = (ConnectionError, TimeoutError, KVStoreError)


@dataclass(frozen=True)
class StoreSpec:
    """Where a plugin's blocks go: a daemon (`url`, `token`) or a local store (`path`)."""

    url: str = ""
    token: str = ""
    path: str = ""
    dram_blocks: int = 1024
    ssd_blocks: int = 65536

    def __post_init__(self) -> None:
        if not self.url and not self.path:
            raise ValueError("kvtier needs a store: set kvtier_url (a `kvtier serve` daemon, "
                             f"or ${env.URL}) or kvtier_path (a local store directory, or ${env.PATH})")
        if self.dram_blocks < 0 or self.ssd_blocks <= 0:
            raise ValueError("kvtier_dram_blocks must be >= 0 (0: SSD tier only) and "
                             "kvtier_ssd_blocks > 0")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "StoreSpec":
        """From an engine's string-keyed config (`kvtier_url`, `kvtier_token`, `kvtier_path`,
        `kvtier_dram_blocks`, `kvtier_ssd_blocks`), falling back to $KVTIER_URL/_TOKEN/_PATH."""
        return cls(
            url=str(options.get("kvtier_url") or env.url()),
            token=str(options.get("kvtier_token") or env.token()),
            path=str(options.get("kvtier_path") or env.path()),
            dram_blocks=int(options.get("kvtier_dram_blocks", 1024)),
            ssd_blocks=int(options.get("kvtier_ssd_blocks", 65536)),
        )


def open_store(ns: Namespace, spec: StoreSpec) -> BlockStore:
    """A store for namespace `ns`; the caller closes it (`close()`) when done. A compressed
    namespace's store encodes on put and decodes on get (`coded`)."""
    if spec.url:
        from kvstore.client import connect
        return coded(connect(spec.url, token=spec.token, namespace=ns), ns)
    from kvstore.config import StoreConfig, TierConfig
    from kvstore.store import TieredStore
    ssd_dir = os.path.join(spec.path, f"{ns.ns_id:016x}")
    ssd = TierConfig("ssd", spec.ssd_blocks, path=ssd_dir)
    dram = (TierConfig("dram", spec.dram_blocks),) if spec.dram_blocks else ()
    return coded(TieredStore(ns, StoreConfig((*dram, ssd))), ns)


def coded(store: BlockStore, ns: Namespace) -> BlockStore:
    """`store` as is for a raw namespace; else wrapped to encode blocks of `ns.codec` on
    put and decode them on get (engine_adapter.kvcodec.CodedStore)."""
    if ns.codec == "raw":
        return store
    import torch

    from engine_adapter.kvcodec import BlockCodec, CodedStore
    return CodedStore(store, BlockCodec(ns.codec, ns.block_shape, getattr(torch, ns.dtype)))


_SHARED: dict[tuple[StoreSpec, bytes], list] = {}   # (spec, ns root) -> [store, users]


def shared_store(ns: Namespace, spec: StoreSpec) -> BlockStore:
    """One store per (spec, namespace) in this process, counted: an engine whose scheduler
    and workers share a process (vLLM's uniproc CPU path) opens a local RocksDB only once."""
    key = (spec, bytes(ns.root_hash))
    entry = _SHARED.get(key)
    if entry is None:
        entry = _SHARED[key] = [open_store(ns, spec), 0]
    entry[1] += 1
    return entry[0]


def release_store(store: BlockStore) -> None:
    """Drop one user of a `shared_store`; the last one closes it."""
    for key, entry in list(_SHARED.items()):
        if entry[0] is store:
            entry[1] -= 1
            if entry[1] == 0:
                del _SHARED[key]
                close_store(store)
            return


def close_store(store: BlockStore) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        close()


def dtype_name(dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16' (the spelling `Namespace.dtype` takes)."""
    return str(dtype).removeprefix("torch.")
