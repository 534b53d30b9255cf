"""`KVTierHiCacheStorage`: kvtier as SGLang's HiCache L3 storage (sglang 0.5.23).

SGLang loads it through its `dynamic` storage backend; see the package docstring for the
flags. It serves both of SGLang's page paths:
- generic (`get`/`set`/`exists` and `batch_*`): SGLang copies each page out of / into its
  host pool as a flat tensor and hands those over;
- direct (`batch_get_v1`/`batch_set_v1`, chosen by `"interface_v1": 1`): SGLang hands over
  host-pool token indices and kvtier copies whole batches between the pool and the store
  itself: one gather or scatter per batch through a preallocated staging buffer (the
  conversion to kvtier's block layout), no per-page tensors.

Keys: SGLang gives a backend only its own page keys (hex SHA-256 chained over token ids,
`sglang.srt.mem_cache.utils.get_hash_str`), never the token ids, so kvtier cannot apply its
own token hashing here. Each key maps deterministically to a kvtier `BlockHash`
(`page_hash`): xxh3_128 over the namespace root hash, this rank's shard and the key string.
Both inputs are process-independent, so pages are found across restarts and servers.
"""
from __future__ import annotations

import logging
import struct
import threading
from typing import Any, Optional, Sequence

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from engine_adapter.fingerprint import canonical, checkpoint_revision
from engine_adapter.plugins.base import (STORE_OUTAGES, StoreSpec, dtype_name, release_store,
                                         shared_store)
from engine_adapter.plugins.sglang.layout import PageGeometry, PoolPages, geometry_of
from kvstore.keys import Namespace
from kvstore.store import PutStatus

KEY_RECIPE = b"kvtier/sglang-hicache-key/v1"
STAGING_BYTES = 64 << 20   # upper bound of each staging buffer (one for reads, one for writes)
MAX_BATCH_PAGES = 128      # SGLang's STORAGE_BATCH_SIZE


def shard_of(config: HiCacheStorageConfig) -> str:
    """Which slice of each page this rank holds: TP ranks split heads, PP stages layers."""
    return (f"tp{config.tp_rank}/{config.tp_size}:pp{config.pp_rank}/{config.pp_size}"
            f":cp{config.attn_cp_rank}/{config.attn_cp_size}")


def key_seed(ns: Namespace, shard: str) -> bytes:
    raw = shard.encode()
    return KEY_RECIPE + bytes(ns.root_hash) + struct.pack("<I", len(raw)) + raw


def page_hashes(seed: bytes, keys: Sequence[str]) -> list[bytes]:
    """SGLang page keys -> kvtier block hashes (xxh3_128 of seed || key)."""
    digest = xxhash.xxh3_128_digest
    return [digest(seed + key.encode()) for key in keys]


def namespace_for(config: HiCacheStorageConfig, geom: PageGeometry, tenant: str = "",
                  codec: str = "raw", revision: str = "") -> Namespace:
    """One kvtier namespace per model, its weights, KV dtype and page size (SGLang's storage
    model name already carries the host pool's page-format tag when it has one). The
    weights are named by `revision` (the `kvtier_revision` option) if set, else by the
    checkpoint the server loads (`weights_of`)."""
    name = config.model_name or "sglang"
    weights = revision or weights_of(name)
    # (a name that resolves to no checkpoint keeps the revision it always had)
    return Namespace(model=name, num_layers=geom.num_layers,
                     num_kv_heads=geom.num_kv_heads, head_dim=geom.head_dim,
                     dtype=dtype_name(geom.dtype), block_tokens=geom.page_size,
                     revision=f"sglang-hicache:{weights}" if weights else "sglang-hicache",
                     tenant=tenant, codec=codec)


def weights_of(model_name: str) -> str:
    """The revision of the checkpoint SGLang serves: its --model-path at its --revision,
    with the settings that change KV on top (config overrides, quantization, load format),
    from the server's arguments; outside a server (a backend made by hand), of the storage
    model name as a path or hub id. "" when neither resolves."""
    args = None
    try:
        from sglang.srt.runtime_context import get_server_args
        args = get_server_args()
    except Exception:  # (no server in this process, or an SGLang without it)
        args = None
    if args is None or not getattr(args, "model_path", None):
        return checkpoint_revision(model_name, fallback="")
    settings = {k: str(getattr(args, k, None)) for k in
                ("json_model_override_args", "quantization", "load_format", "dtype",
                 "kv_cache_dtype")}
    return checkpoint_revision(str(args.model_path), getattr(args, "revision", None),
                               hub_dir=getattr(args, "download_dir", None),
                               extra=canonical(settings), fallback="")


def _stored(statuses) -> list[bool]:
    return [st is not PutStatus.NO_SPACE for st in statuses]


def _outage(error: BaseException, answer):
    """`answer` (what an empty store would say), the outage logged."""
    logging.getLogger("kvtier.sglang").warning(
        "the KV store did not answer (%s): SGLang computes instead", error)
    return answer


class KVTierHiCacheStorage(HiCacheStorage):
    """SGLang calls `KVTierHiCacheStorage(storage_config, kwargs)` and then
    `register_mem_pool_host(pool)`; the store opens there, once the page geometry is known.
    Options come from the backend's extra config (`kvtier_url`, `kvtier_token`,
    `kvtier_path`, `kvtier_dram_blocks`, `kvtier_ssd_blocks`, `kvtier_tenant`, `kvtier_revision`
    (a name for the weights; default: their fingerprint), `kvtier_codec`:
    blocks stored compressed, docs/compression.md)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        if storage_config.is_mla_model:
            raise ValueError("kvtier's SGLang backend does not support MLA models yet "
                             "(their pages are shared across TP ranks)")
        options = storage_config.extra_config or {}
        self.config = storage_config
        self.spec = StoreSpec.from_options(options)   # fails here on a missing store option
        self.tenant = str(options.get("kvtier_tenant", ""))
        self.codec = str(options.get("kvtier_codec", "raw"))
        self.revision = str(options.get("kvtier_revision") or "")
        self.store = None

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        geom = geometry_of(mem_pool_host)
        self.close()
        self.ns = namespace_for(self.config, geom, self.tenant, self.codec, self.revision)
        self.seed = key_seed(self.ns, shard_of(self.config))
        self.pages = PoolPages(geom, mem_pool_host.kv_buffer)
        chunk = max(1, min(MAX_BATCH_PAGES, STAGING_BYTES // geom.block_bytes))
        self._staging = {d: torch.empty((chunk, *geom.block_shape), dtype=geom.dtype)
                         for d in ("get", "set")}
        self._locks = {d: threading.Lock() for d in ("get", "set")}
        self.store = shared_store(self.ns, self.spec)

    def close(self) -> None:
        if self.store is not None:
            release_store(self.store)
            self.store = None

    def _hashes(self, keys: Sequence[str]) -> list[bytes]:
        if self.store is None:
            raise RuntimeError("KVTierHiCacheStorage: register_mem_pool_host() was not called")
        return page_hashes(self.seed, keys)

    def _chunks(self, n: int, direction: str):
        step = self._staging[direction].shape[0]
        return [(i, min(i + step, n)) for i in range(0, n, step)]

    # ------------------------------------------------------------------ lookups

    # A store that cannot answer (STORE_OUTAGES) answers as if empty and stores nothing:
    # SGLang computes, as with no storage at all, instead of failing the request.

    def exists(self, key: str) -> bool:
        try:
            return self.store.contains_n(self._hashes([key]))[0]
        except STORE_OUTAGES as e:
            return _outage(e, False)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, are stored."""
        try:
            return self.store.match_prefix(self._hashes(keys)).num_blocks
        except STORE_OUTAGES as e:
            return _outage(e, 0)

    # ------------------------------------------------------------------ direct page path

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        hashes, page_ids = self._hashes(keys), self.pages.page_ids(host_indices)
        assert len(page_ids) == len(hashes), "SGLang hands over one page of indices per key"
        ok: list[bool] = []
        with self._locks["set"]:
            for lo, hi in self._chunks(len(hashes), "set"):
                staging = self._staging["set"][: hi - lo]
                self.pages.gather(page_ids[lo:hi], staging)
                try:
                    ok += _stored(self.store.put_n(hashes[lo:hi], staging))
                except STORE_OUTAGES as e:
                    return _outage(e, ok + [False] * (len(hashes) - lo))
        return ok

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load stored pages straight into the host pool; a miss (absent or corrupt) leaves
        its page untouched and reads False."""
        hashes, page_ids = self._hashes(keys), self.pages.page_ids(host_indices)
        assert len(page_ids) == len(hashes), "SGLang hands over one page of indices per key"
        ok: list[bool] = []
        with self._locks["get"]:
            for lo, hi in self._chunks(len(hashes), "get"):
                staging = self._staging["get"][: hi - lo]
                try:
                    found = [t is not None for t in self.store.get_n(hashes[lo:hi], staging)]
                except STORE_OUTAGES as e:
                    return _outage(e, ok + [False] * (len(hashes) - lo))
                hit = [i for i, f in enumerate(found) if f]
                if len(hit) == len(found):
                    self.pages.scatter(page_ids[lo:hi], staging)
                elif hit:
                    sel = torch.tensor(hit, dtype=torch.int64)
                    self.pages.scatter(page_ids[lo:hi][sel], staging[sel])
                ok += found
        return ok

    # ------------------------------------------------------------------ generic path

    def batch_set(self, keys: list[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """`values`: SGLang's flat data pages (`get_data_page`), one per key."""
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one flat data page per key")
        hashes, ok = self._hashes(keys), True
        with self._locks["set"]:
            for lo, hi in self._chunks(len(hashes), "set"):
                staging = self._staging["set"][: hi - lo]
                for j in range(lo, hi):
                    self.pages.flat_page_to_block(values[j], staging[j - lo])
                try:
                    ok &= all(_stored(self.store.put_n(hashes[lo:hi], staging)))
                except STORE_OUTAGES as e:
                    return _outage(e, False)
        return ok

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> list[Optional[torch.Tensor]]:
        """Per key the flat data page (written into `target_locations[i]` when given, as
        SGLang's `get_dummy_flat_data_page` buffers), or None for a miss."""
        hashes = self._hashes(keys)
        out: list[Optional[torch.Tensor]] = []
        with self._locks["get"]:
            for lo, hi in self._chunks(len(hashes), "get"):
                staging = self._staging["get"][: hi - lo]
                try:
                    tiers = self.store.get_n(hashes[lo:hi], staging)
                except STORE_OUTAGES as e:
                    return _outage(e, out + [None] * (len(hashes) - lo))
                for j, tier in enumerate(tiers, start=lo):
                    out.append(None if tier is None else self._flat_page(staging[j - lo], target_locations, j))
        return out

    def _flat_page(self, block: torch.Tensor, targets: Optional[Any], j: int) -> torch.Tensor:
        dst = targets[j] if targets is not None else torch.empty(block.numel(), dtype=block.dtype)
        self.pages.block_to_flat_page(block, dst)
        return dst

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]
