"""`KVTierConnector`: a vLLM v1 KV connector (`KVConnectorBase_V1`) backed by kvtier.

Enable it with (pinned against vLLM 0.32 / 0.33):

    from vllm.config import KVTransferConfig
    KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="engine_adapter.plugins.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",   # a corrupt/evicted block is recomputed
        kv_connector_extra_config={"kvtier_path": "/var/lib/kvtier"},  # or "kvtier_url"
    )

Extra config keys: `kvtier_url` + `kvtier_token` (a `kvtier serve` daemon; engine instances
pointed at one daemon share their prefixes; the token also comes from $KVTIER_TOKEN) or
`kvtier_path` (an in-process store; scheduler and worker must share the process, as in
vLLM's uniproc CPU path), `kvtier_tenant`, `kvtier_revision` (a name for the weights;
default: the checkpoint's content fingerprint or hub commit, engine_adapter.fingerprint),
`kvtier_async_load` (load between scheduler
steps), `kvtier_save_decode` (also save the blocks that decoding fills, so a follow-up turn
that repeats the answer finds it), `kvtier_dram_blocks`, `kvtier_ssd_blocks`.
Blocks are keyed by kvtier's own hash of the token ids, never by vLLM's block hash. Loads
are layer-wise: `start_load_kv` starts them and each layer's `wait_for_layer_load` waits
only for that layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)

from engine_adapter.fingerprint import canonical, checkpoint_revision
from engine_adapter.plugins.base import StoreSpec, dtype_name, release_store, shared_store
from engine_adapter.plugins.vllm.metadata import KVTierMetadata
from engine_adapter.plugins.vllm.scheduler_side import SchedulerSide
from engine_adapter.plugins.vllm.worker_side import WorkerSide
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def namespace_for(vllm_config: "VllmConfig", tp_rank: int = 0) -> Namespace:
    """kvtier namespace of the model vLLM serves (its paged KV layout and cache dtype). Its
    revision names the weights: `kvtier_revision` if set, else the checkpoint's
    (`engine_adapter.fingerprint.checkpoint_revision`: a local checkpoint's content, a hub
    id's commit)."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    dtype = model.dtype if cache.cache_dtype in (None, "auto") else cache.cache_dtype
    name = str(model.model)
    if parallel.tensor_parallel_size > 1:  # each rank holds its own heads' share of a block
        name = f"{name}#tp{tp_rank}/{parallel.tensor_parallel_size}"
    return Namespace(model=name, num_layers=model.get_num_layers(parallel),
                     num_kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
                     dtype=dtype_name(dtype).replace("fp8_e4m3", "float8_e4m3fn"),
                     block_tokens=cache.block_size, revision=model_revision(vllm_config, extra),
                     tenant=str(extra.get("kvtier_tenant", "")),
                     codec=str(extra.get("kvtier_codec", "raw")))


def model_revision(vllm_config: "VllmConfig", extra: dict) -> str:
    """`kvtier_revision`, else the checkpoint's (its files' content or its hub commit, from
    the cache vLLM downloads into) with what vLLM changes on top of it: the model config it
    runs (overrides, rope scaling), quantization and load format."""
    if extra.get("kvtier_revision"):
        return str(extra["kvtier_revision"])
    model = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    hf_config = getattr(model, "hf_config", None)
    settings = {"hf_config": hf_config.to_dict() if hf_config is not None else None,
                "quantization": getattr(model, "quantization", None),
                "load_format": str(getattr(load, "load_format", "")) if load else ""}
    return checkpoint_revision(str(model.model), model.revision,
                               hub_dir=getattr(load, "download_dir", None) if load else None,
                               extra=canonical(settings))


def _flag(extra: dict, key: str) -> bool:
    return str(extra.get(key, "false")).lower() in ("1", "true", "yes")


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError):  # no TP group (scheduler process, unit tests)
        return 0


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tcfg = self._kv_transfer_config
        if getattr(tcfg, "kv_load_failure_policy", "recompute") != "recompute":
            raise ValueError("KVTierConnector needs kv_load_failure_policy='recompute': a kvtier "
                             "block found evicted or corrupt at load time is recomputed")
        extra = dict(tcfg.kv_connector_extra_config or {})
        spec = StoreSpec.from_options(extra)
        is_worker = role == KVConnectorRole.WORKER
        self.ns = namespace_for(vllm_config, _tp_rank() if is_worker else 0)
        self.store = shared_store(self.ns, spec)
        self._lora_revisions: dict[tuple, str] = {}
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if is_worker:
            dtype = getattr(torch, self.ns.dtype)
            self.worker_side = WorkerSide(self.ns, self.store, dtype)
        else:
            self.scheduler_side = SchedulerSide(self.ns, self.store, _flag(extra, "kvtier_async_load"),
                                                _flag(extra, "kvtier_save_decode"))

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        marks = self._marks(request)
        return self.scheduler_side.lookup(request.request_id, list(request.prompt_token_ids or ()),
                                          num_computed_tokens, request.all_token_ids,
                                          None if marks is None else self._extra(request), marks)

    def _extra(self, request: "Request") -> bytes | None:
        """What all of the request's KV depends on besides its token ids and the model, as
        vLLM's own prefix cache keys it: the LoRA adapter (by name, path and the adapter
        files' fingerprint), the cache salt (images: `_marks`). None for prompt embeddings
        (their KV is not named by token ids at all)."""
        if getattr(request, "prompt_embeds", None) is not None:
            return None
        parts = []
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            key = (lora.lora_name, getattr(lora, "lora_path", ""), getattr(lora, "lora_int_id", 0))
            rev = self._lora_revisions.get(key)
            if rev is None:  # (once per adapter and process: vLLM loads it once, too)
                path = getattr(lora, "lora_path", "") or ""
                rev = checkpoint_revision(path, fallback="") if path else ""
                self._lora_revisions[key] = rev
            parts.append(f"lora|{lora.lora_name}|{rev}")
        if getattr(request, "cache_salt", None):
            parts.append(f"salt|{request.cache_salt}")
        return "\n".join(parts).encode()

    def _marks(self, request: "Request") -> dict[int, bytes] | None:
        """Each multimodal input's content hash (vLLM's identifier) and placeholder, mixed
        into the hash of the block its placeholder starts in (the placeholder's token ids
        are the same for any image; the chain carries it into every later block). Salted
        into every block before, text ahead of the first image was never shared. None (no
        load, no save) where an input has no identifier: its KV would pass for another's."""
        marks: dict[int, bytes] = {}
        for mm in getattr(request, "mm_features", None) or ():
            ident = getattr(mm, "identifier", None)
            if not ident:
                return None
            pos = getattr(mm, "mm_position", None)
            offset = int(getattr(pos, "offset", 0) or 0)
            length = int(getattr(pos, "length", 0) or 0)
            block = offset // self.ns.block_tokens
            marks[block] = marks.get(block, b"") + f"\nmm|{ident}|{offset}|{length}".encode()
        return marks

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self.scheduler_side.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler_side.build(scheduler_output.scheduled_new_reqs,
                                         scheduler_output.scheduled_cached_reqs,
                                         scheduler_output.num_scheduled_tokens)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler_side.finished(request.request_id)
        return False, None   # saves are synchronous: nothing holds the blocks

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker_side.start_load(meta)
        self.worker_side.begin_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self.worker_side.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self.worker_side.finish_step(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, (self.worker_side.take_finished() or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.store is not None:
            release_store(self.store)
            self.store = None
