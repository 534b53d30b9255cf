"""Layer-wise loads for the vLLM connector: a step's hit blocks are fetched from kvtier and
written into vLLM's paged KV cache one layer at a time on a background thread, so that the
forward pass starts at once and each attention layer waits only for its own layer.

    start(meta)       -> returns at once; the job fetches every block (one `get_n`: a kvtier
                         block holds all layers), then writes layer 0, 1, ... in model order,
                         marking each layer ready as it lands
    wait_layer(i)     -> blocks until layer i is in place (vLLM's `wait_for_layer_load`)
    finish()          -> blocks until the whole job is done; before any store call of the
                         step's saves and before the next step, so the store is never used
                         from two threads at once

A block that comes back as a miss (evicted since lookup, or corrupt) and every later block of
that request are not written and are reported as load errors, so vLLM recomputes them. An
exception in the job is raised in the thread that waits. Copies are numpy (single-threaded
memcpy per block and layer, no torch intra-op pool), through integer views of the cache, so
bf16 and fp8 caches copy as raw bytes.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from engine_adapter.plugins.base import STORE_OUTAGES
from kvstore.api import BlockStore, leading_hits
from engine_adapter.plugins.vllm.metadata import BlockTransfer

log = logging.getLogger("kvtier.vllm")

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array of a same-size integer type (any strides)."""
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy()


class LayerwiseLoader:
    def __init__(self, store: BlockStore, views: Sequence[torch.Tensor], block_shape: tuple,
                 dtype: torch.dtype) -> None:
        self.store, self.dtype, self.block_shape = store, dtype, tuple(block_shape)
        self.views = [numpy_view(v) for v in views]   # each [num_blocks, 2, bt, H, D]
        self.ready = [threading.Event() for _ in views]
        self.load_errors: set[int] = set()
        self.finished_recving: set[str] = set()
        self.num_loaded_blocks = self.num_failed_blocks = 0
        self.num_layer_waits = 0      # wait_layer calls that found a load in flight
        self._staging = torch.empty(0, dtype=dtype)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._job: Future | None = None
        self._error: BaseException | None = None

    def start(self, loads: Sequence[BlockTransfer]) -> None:
        """Begin this step's loads (the previous step's job is already finished)."""
        assert self._job is None, "finish() the previous step's load first"
        if not loads:
            return
        for ev in self.ready:
            ev.clear()
        self._error = None
        self._job = self._pool.submit(self._run, list(loads))

    def wait_layer(self, layer: int) -> None:
        if self._job is None:
            return
        self.num_layer_waits += 1
        self.ready[layer].wait()
        if self._error is not None:
            self.finish()   # raises it here, in the forward pass

    def finish(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.result()

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ the job

    def _run(self, loads: list[BlockTransfer]) -> None:
        try:
            rows, block_ids = self._fetch(loads)
            src = numpy_view(self._staging)
            for layer, view in enumerate(self.views):
                if len(rows):
                    view[block_ids] = src[rows, layer]   # [n, 2, bt, H, D] per layer
                self.ready[layer].set()
        except BaseException as e:
            self._error = e   # seen by wait_layer before the events below release it
            raise
        finally:
            for ev in self.ready:   # a failed job must not leave a layer waiting forever
                ev.set()

    def _fetch(self, loads: list[BlockTransfer]) -> tuple[np.ndarray, np.ndarray]:
        """get_n every block; (staging rows, vLLM block ids) of those to write."""
        hashes = [h for t in loads for h in t.hashes]
        staging = self._staging_for(len(hashes))
        try:
            found = self.store.get_n(hashes, staging)
        except STORE_OUTAGES as e:  # every block a load error: vLLM recomputes them (the
            # exception failed the step)
            log.warning("the KV store did not answer (%s): recomputing %d blocks", e, len(hashes))
            found = [None] * len(hashes)
        rows: list[int] = []
        ids: list[int] = []
        start = 0
        for t in loads:
            n = len(t.hashes)
            ok = leading_hits(found[start:start + n])
            rows.extend(range(start, start + ok))
            ids.extend(t.block_ids[:ok])
            self.load_errors.update(t.block_ids[ok:])   # vLLM recomputes from the first miss
            self.num_loaded_blocks += ok
            self.num_failed_blocks += n - ok
            if t.is_async:
                self.finished_recving.add(t.req_id)
            start += n
        return np.asarray(rows, dtype=np.int64), np.asarray(ids, dtype=np.int64)

    def _staging_for(self, n: int) -> torch.Tensor:
        """`[n, L, 2, bt, H, D]`, reused across steps (fresh pages cost a first touch)."""
        if self._staging.dim() == 1 or self._staging.shape[0] < n:
            self._staging = torch.empty((n, *self.block_shape), dtype=self.dtype)
        return self._staging[:n]
