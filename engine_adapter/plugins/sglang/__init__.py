"""kvtier under SGLang (0.5.23): a HiCache L3 storage backend, `KVTierHiCacheStorage`.

SGLang loads it through its `dynamic` storage backend; nothing is registered in SGLang:

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "engine_adapter.plugins.sglang",
            "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
            "kvtier_url": "tcp://HOST:PORT", "kvtier_token": "..."}'

`kvtier_path` (a local store directory) may replace `kvtier_url`; both fall back to
$KVTIER_URL / $KVTIER_PATH (`engine_adapter.plugins.base.StoreSpec`). `"interface_v1": 1`
selects the direct page path (kvtier copies between SGLang's host pool and the store in
batches); without it SGLang uses the generic per-page `batch_get`/`batch_set`. Supported:
MHA models, host layouts layer_first, page_first, page_first_direct and page_head.

Importing this package imports SGLang (the class must subclass its `HiCacheStorage`).
"""
from engine_adapter.plugins.sglang.storage import KVTierHiCacheStorage

BACKEND_NAME = "kvtier"
MODULE_PATH = "engine_adapter.plugins.sglang"
CLASS_NAME = "KVTierHiCacheStorage"


def dynamic_backend_config(**options) -> dict:
    """SGLang's `--hicache-storage-backend-extra-config` for kvtier (direct page path on),
    plus the kvtier options given (`kvtier_url=...` or `kvtier_path=...`, ...)."""
    return {"backend_name": BACKEND_NAME, "module_path": MODULE_PATH,
            "class_name": CLASS_NAME, "interface_v1": 1, **options}


__all__ = ["KVTierHiCacheStorage", "dynamic_backend_config"]
