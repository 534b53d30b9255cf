"""Helpers shared by the SGLang tests and the SGLang instance child: SGLang 0.5.23's real MHA
host KV pool, its storage-backend factory, its page keys and its cache controller's own
page-transfer methods, driven the way SGLang drives them."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from engine_adapter.plugins.sglang import dynamic_backend_config

PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 8
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def make_host_pool(layout: str, seed: int = 0) -> MHATokenToKVPoolHost:
    """A host pool as SGLang builds it from a device pool, filled with random KV."""
    device = MHATokenToKVPool(256, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS)
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
        pin_memory=False, device="cpu", device_capacity_tokens=device.size,
        start_layer=device.start_layer, end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging)
    gen = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(torch.float16))
    return host


def storage_config(model="test/model", tp_rank=0, **options) -> HiCacheStorageConfig:
    """The config SGLang hands a storage backend; `options`: kvtier's (kvtier_path=... or
    kvtier_url=..., ...)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model, extra_config=dynamic_backend_config(**options))


def create_backend(config: HiCacheStorageConfig, host_pool):
    """What HiCacheController.attach_storage_backend does: factory, then register the pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config, host_pool)
    backend.register_mem_pool_host(host_pool)
    return backend


def sglang_keys(tokens: list[int]) -> list[str]:
    """Page keys exactly as SGLang computes them for a token sequence."""
    return get_hash_str(tokens, None, page_size=PAGE)


def kv_of_token(pool, token: int) -> torch.Tensor:
    """[2, L, H, D] of one host-pool token (a view), per SGLang's `init_kv_buffer` dims."""
    buf = pool.kv_buffer
    if pool.layout == "layer_first":        # [2, L, size, H, D]
        return buf[:, :, token]
    if pool.layout == "page_first":         # [2, size, L, H, D]
        return buf[:, token]
    page, t = divmod(token, PAGE)
    if pool.layout == "page_first_direct":  # [2, pages, L, T, H, D]
        return buf[:, page, :, t]
    return buf[:, page, :, t].permute(0, 2, 1, 3)  # page_head [2, pages, H, T, L, D]


def pages_kv(pool, host_indices: torch.Tensor) -> torch.Tensor:
    """[tokens, 2, L, H, D] of the given host-pool tokens."""
    return torch.stack([kv_of_token(pool, int(i)) for i in host_indices])


def computed_kv(tokens: list[int]) -> torch.Tensor:
    """[T, 2, L, H, D] fp16: what a model would compute, a function of the tokens so far."""
    t = torch.tensor(tokens, dtype=torch.float32).cumsum(0) % 97   # depends on the whole prefix
    grid = (torch.arange(LAYERS)[:, None, None] * 0.5 + torch.arange(HEADS)[None, :, None] * 0.25
            + torch.arange(DIM)[None, None, :] * 0.01)                # [L, H, D]
    k = t[:, None, None, None] * 0.01 + grid                           # [T, L, H, D]
    return torch.stack((k, -k), dim=1).to(torch.float16)


def write_tokens(pool, host_indices: torch.Tensor, kv: torch.Tensor) -> None:
    """Put `kv` [T, 2, L, H, D] into the pool's tokens (what a forward pass leaves there)."""
    for i, token in enumerate(host_indices.tolist()):
        kv_of_token(pool, token).copy_(kv[i])


def controller(backend, pool) -> SimpleNamespace:
    """The state HiCacheController's page-transfer methods read."""
    return SimpleNamespace(storage_backend=backend, storage_host_pool=pool, page_size=PAGE)


class _Op:
    request_id = "test"

    def is_terminated(self) -> bool:
        return False


def ctl_set(backend, pool, keys, idx, direct: bool) -> bool:
    fn = HiCacheController._page_set_zero_copy if direct else HiCacheController._generic_page_set
    return fn(controller(backend, pool), keys, idx)


def ctl_get(backend, pool, keys, idx, direct: bool) -> int:
    fn = HiCacheController._page_get_zero_copy if direct else HiCacheController._generic_page_get
    return fn(controller(backend, pool), _Op(), keys, idx)
