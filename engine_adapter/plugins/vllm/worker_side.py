"""Worker-side half of the kvtier vLLM connector: loads hit blocks into vLLM's paged KV cache
layer by layer while the forward pass runs, and saves the blocks each step completes.

Loads (`loading.LayerwiseLoader`): `start_load_kv` starts a background job that fetches the
step's blocks with one `get_n` and writes them layer by layer; each attention layer's
`wait_for_layer_load` waits only for its own layer. A block that comes back as a miss
(evicted since lookup, or corrupt) and every later block of that request are reported
through `get_block_ids_with_load_errors`, so vLLM recomputes them
(`kv_load_failure_policy="recompute"`): wrong KV never reaches the model.
Saves: layer-wise as vLLM calls `save_kv_layer` (each layer's blocks are copied out while
the next layer runs), finished and `put_n` in `wait_for_save` after the step's load job has
ended; any layer vLLM did not hand over is copied there. Saves are synchronous, so a
finished request holds no blocks. Host copies are numpy (single-threaded memcpy).
"""
from __future__ import annotations

import logging
from typing import Mapping

import numpy as np
import torch

from engine_adapter.plugins.base import STORE_OUTAGES
from kvstore.api import BlockStore
from engine_adapter.plugins.vllm import layout
from engine_adapter.plugins.vllm.loading import LayerwiseLoader, numpy_view
from engine_adapter.plugins.vllm.metadata import KVTierMetadata
from kvstore.keys import Namespace


class WorkerSide:
    def __init__(self, ns: Namespace, store: BlockStore, torch_dtype: torch.dtype) -> None:
        self.ns, self.store, self.dtype = ns, store, torch_dtype
        self.names: list[str] = []
        self.loader: LayerwiseLoader | None = None
        self.num_saved_blocks = 0
        self._views: list[np.ndarray] = []
        self._save_ids: np.ndarray | None = None
        self._save_buf: torch.Tensor | None = None
        self._layers_saved: set[int] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.names = layout.layer_order(list(kv_caches))
        if len(self.names) != self.ns.num_layers:
            raise layout.LayoutError(f"vLLM registered {len(self.names)} KV cache layers; the "
                                     f"kvtier namespace expects {self.ns.num_layers}")
        _, _, bt, H, D = self.ns.block_shape
        views = [layout.block_view(kv_caches[n], bt, H, D) for n in self.names]
        if any(v.device.type != "cpu" for v in views):
            raise layout.LayoutError("kvtier's vLLM connector copies through host memory: the "
                                     "KV cache must be on the CPU (vLLM's CPU backend)")
        self._index = {n: i for i, n in enumerate(self.names)}
        self._views = [numpy_view(v) for v in views]
        self.loader = LayerwiseLoader(self.store, views, self.ns.block_shape, self.dtype)

    # ------------------------------------------------------------------ loads

    def start_load(self, meta: KVTierMetadata) -> None:
        self.loader.start(meta.loads)

    def wait_layer(self, layer_name: str) -> None:
        layer = self._index.get(layer_name)
        if layer is not None:
            self.loader.wait_layer(layer)

    @property
    def num_loaded_blocks(self) -> int:
        return self.loader.num_loaded_blocks if self.loader else 0

    @property
    def num_failed_blocks(self) -> int:
        return self.loader.num_failed_blocks if self.loader else 0

    # ------------------------------------------------------------------ saves

    def begin_step(self, meta: KVTierMetadata) -> None:
        ids = [b for t in meta.saves for b in t.block_ids]
        self._layers_saved = set()
        if not ids:
            self._save_ids = self._save_buf = None
            return
        self._save_ids = np.asarray(ids, dtype=np.int64)
        self._save_buf = torch.empty((len(ids), *self.ns.block_shape), dtype=self.dtype)

    def save_layer(self, layer_name: str) -> None:
        layer = self._index.get(layer_name)
        if self._save_ids is None or layer is None:
            return
        self._copy_out(layer)

    def _copy_out(self, layer: int) -> None:
        numpy_view(self._save_buf)[:, layer] = self._views[layer][self._save_ids]
        self._layers_saved.add(layer)

    def finish_step(self, meta: KVTierMetadata) -> None:
        """End of the step: the load job has ended (raising its error, if any), then the
        step's saves are completed and stored."""
        self.loader.finish()
        if self._save_ids is None:
            return
        for layer in range(len(self._views)):
            if layer not in self._layers_saved:
                self._copy_out(layer)
        hashes = [h for t in meta.saves for h in t.hashes]
        try:
            self.store.put_n(hashes, self._save_buf)
            self.num_saved_blocks += len(hashes)
        except STORE_OUTAGES as e:  # (the exception failed vLLM's step: its outputs lost)
            logging.getLogger("kvtier.vllm").warning(
                "the KV store did not answer (%s): %d blocks not saved", e, len(hashes))
        finally:
            self._save_ids = self._save_buf = None

    def take_finished(self) -> set[str]:
        self.loader.finish()   # vLLM may ask before wait_for_save (deferred finalize)
        done, self.loader.finished_recving = self.loader.finished_recving, set()
        return done

    def take_load_errors(self) -> set[int]:
        self.loader.finish()
        errors, self.loader.load_errors = self.loader.load_errors, set()
        return errors

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
