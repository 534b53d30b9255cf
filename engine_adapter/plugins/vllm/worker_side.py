"""Worker-side half of the kvtier vLLM connector: loads hit blocks into vLLM's paged KV
cache before the forward pass and saves the blocks it completes after it.

Loads: one `get_n` into a staging tensor per step, then one indexed write per layer. A block
that comes back as a miss (evicted since lookup, or corrupt) and every later block of that
request are reported through `get_block_ids_with_load_errors`, so vLLM recomputes them
(`kv_load_failure_policy="recompute"`): wrong KV never reaches the model.
Saves: layer-wise as vLLM calls `save_kv_layer` (each layer's blocks are copied out while
the next layer runs), finished and `put_n` in `wait_for_save`; any layer vLLM did not hand
over is gathered there. Saves are synchronous, so a finished request holds no blocks.
"""
from __future__ import annotations

from typing import Mapping

import torch

from engine_adapter.plugins.base import KVStoreLike
from engine_adapter.plugins.vllm import layout
from engine_adapter.plugins.vllm.metadata import KVTierMetadata
from kvstore.keys import Namespace


class WorkerSide:
    def __init__(self, ns: Namespace, store: KVStoreLike, torch_dtype: torch.dtype) -> None:
        self.ns, self.store, self.dtype = ns, store, torch_dtype
        self.names: list[str] = []
        self.views: list[torch.Tensor] = []
        self.finished_recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.num_loaded_blocks = self.num_failed_blocks = self.num_saved_blocks = 0
        self._save_ids: torch.Tensor | None = None
        self._save_buf: torch.Tensor | None = None
        self._layers_saved: set[int] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.names = layout.layer_order(list(kv_caches))
        if len(self.names) != self.ns.num_layers:
            raise layout.LayoutError(f"vLLM registered {len(self.names)} KV cache layers; the "
                                     f"kvtier namespace expects {self.ns.num_layers}")
        _, _, bt, H, D = self.ns.block_shape
        self.views = [layout.block_view(kv_caches[n], bt, H, D) for n in self.names]
        self._index = {n: i for i, n in enumerate(self.names)}

    # ------------------------------------------------------------------ loads

    def load(self, meta: KVTierMetadata) -> None:
        if not meta.loads:
            return
        hashes = [h for t in meta.loads for h in t.hashes]
        staging = torch.empty((len(hashes), *self.ns.block_shape), dtype=self.dtype)
        found = self.store.get_n(hashes, staging)
        good_rows, good_ids, start = [], [], 0
        for t in meta.loads:
            n = len(t.hashes)
            ok = next((i for i, tier in enumerate(found[start:start + n]) if tier is None), n)
            good_rows.extend(range(start, start + ok))
            good_ids.extend(t.block_ids[:ok])
            self.load_errors.update(t.block_ids[ok:])   # vLLM recomputes from the first miss
            self.num_loaded_blocks += ok
            self.num_failed_blocks += n - ok
            if t.is_async:
                self.finished_recving.add(t.req_id)
            start += n
        if good_rows:
            rows = staging if len(good_rows) == len(hashes) else staging[torch.tensor(good_rows)]
            layout.scatter_blocks(rows, self.views, torch.tensor(good_ids, dtype=torch.long))

    # ------------------------------------------------------------------ saves

    def begin_step(self, meta: KVTierMetadata) -> None:
        ids = [b for t in meta.saves for b in t.block_ids]
        self._layers_saved = set()
        if not ids:
            self._save_ids = self._save_buf = None
            return
        self._save_ids = torch.tensor(ids, dtype=torch.long)
        self._save_buf = torch.empty((len(ids), *self.ns.block_shape), dtype=self.dtype)

    def save_layer(self, layer_name: str) -> None:
        layer = self._index.get(layer_name)
        if self._save_ids is None or layer is None:
            return
        layout.gather_layer(self.views[layer], layer, self._save_ids.to(self.views[layer].device),
                            self._save_buf)
        self._layers_saved.add(layer)

    def finish_saves(self, meta: KVTierMetadata) -> None:
        if self._save_ids is None:
            return
        for layer, view in enumerate(self.views):
            if layer not in self._layers_saved:
                layout.gather_layer(view, layer, self._save_ids.to(view.device), self._save_buf)
        hashes = [h for t in meta.saves for h in t.hashes]
        self.store.put_n(hashes, self._save_buf)
        self.num_saved_blocks += len(hashes)
        self._save_ids = self._save_buf = None

    def take_finished(self) -> set[str]:
        done, self.finished_recving = self.finished_recving, set()
        return done

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors
