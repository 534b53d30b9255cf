"""The bridge between the paged KV cache and a KV store (in-process `TieredStore` or a
remote `kvstore.Client`): look up a prompt's prefix, load hit blocks, save new blocks.

Loads are synchronous (the request waits for its prefix anyway) and batched: one read
straight into the request's fresh cache blocks on CPU (elsewhere into one staging tensor,
then one `scatter_blocks`). With a store that has `get_prefix_n` the lookup and the read
are one round trip (`load_prefix`: the longest stored prefix and its bytes); with another,
`num_prefix_blocks` (MATCH), then `load` (`get_n`). A miss or a corrupt block ends the
usable prefix there; the blocks after it are recomputed, so wrong KV never reaches the
model. Saves copy the blocks
out of the cache on the step thread (one numpy gather on CPU, `gather_blocks` on a device,
so a block may be reused right after) and `put_n` them on a background thread through a
bounded queue: a full queue or a failing store drops the save and counts it; the engine
never stalls or crashes for a save. A prefill's blocks thus reach the store chunk by chunk
while the next chunk computes.

A compressed namespace (`codec` other than raw, docs/compression.md) is coded here and
only here: `_save_loop` encodes right before `put_n`, `_load_encoded` decodes right after
`get_n` (engine_adapter.kvcodec, batched on the cache's device).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

import kernels
from engine_adapter.kvcodec import BlockCodec
from kvstore.api import PutStatus, leading_hits
from kvstore.keys import BlockHash

log = logging.getLogger("kvtier.connector")


class KVStoreLike(Protocol):
    """What the connector needs of a store; `TieredStore` and `kvstore.Client` both fit."""

    def put_n(self, hashes: Sequence[bytes], srcs: Any) -> list: ...
    def get_n(self, hashes: Sequence[bytes], dsts: Any) -> list: ...    # None per miss
    def match_prefix(self, hashes: Sequence[bytes]) -> Any: ...          # has .num_blocks
    def contains_n(self, hashes: Sequence[bytes]) -> list[bool]: ...
    # and, where the store has it (TieredStore and Client do): get_prefix_n(hashes, dsts),
    # the longest stored prefix read (.num_blocks of it)


@dataclass
class ConnectorStats:
    lookups: int = 0
    lookup_errors: int = 0
    loaded_blocks: int = 0
    load_misses: int = 0          # matched, then missing or corrupt on read: recomputed
    saved_blocks: int = 0
    save_dropped_blocks: int = 0  # queue full: the save was skipped
    save_errors: int = 0          # blocks whose put_n raised
    save_unencodable_blocks: int = 0  # zstd frames too big for their slot: not stored
    save_refused_blocks: int = 0  # the store answered NO_SPACE (full): not stored
    store_down_skips: int = 0     # lookups and saves skipped while the store was down


_STOP = object()
# After the store times out or its connection fails, lookups and saves skip it for a while
# (recomputing, dropping saves), doubling from DOWN_FIRST_S to DOWN_MAX_S while it keeps
# failing: a stopped daemon cost every new request the client's whole timeout (30 s each,
# every decode of the engine waiting behind it) and close() a timeout per queued save.
# The save thread probes it (one CONTAINS) at the end of each pause, so the engine's thread
# never waits on a store already seen down; the first failure still costs one call's timeout.
DOWN_FIRST_S, DOWN_MAX_S = 1.0, 30.0
OUTAGES = (ConnectionError, TimeoutError)  # (the SDK's ConnectError and RequestTimeout)
_PROBE_HASH = bytes(16)


class StoreConnector:
    def __init__(self, store: KVStoreLike, kv_cache: torch.Tensor, queue_batches: int = 64,
                 codec: str = "raw") -> None:
        store_codec = getattr(getattr(store, "ns", None), "codec", codec)
        if store_codec != codec:
            raise ValueError(f"the store's namespace holds {store_codec} blocks but the engine "
                             f"codes them {codec}: set EngineConfig(kv_codec={store_codec!r})")
        self.store, self.kv_cache = store, kv_cache
        # a prefix and its bytes in one round trip (load_prefix), or MATCH then GET
        self.reads_prefix = callable(getattr(store, "get_prefix_n", None))
        self.codec = BlockCodec.for_cache(codec, kv_cache)
        self.stats = ConnectorStats()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        self._staging = kv_cache.new_empty((0, *kv_cache.shape[1:]))
        # the breaker: `_down` (lookups and saves skip the store) from an outage until a probe
        # answers; `_pause` the last wait between probes, kept through a probe's answer
        # (half-open) and cleared by a real call that succeeds, so a store whose CONTAINS
        # answers while its GETs time out still backs off
        self._down, self._pause, self._down_until = False, 0.0, 0.0
        self._thread = threading.Thread(target=self._save_loop, name="kvtier-save", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def store_down(self) -> bool:
        """Is the store being skipped (seen down, not answering a probe since)?"""
        return self._down

    def _store_up(self) -> bool:
        """Is the store to be asked? Counts a skip."""
        if self._down:
            self.stats.store_down_skips += 1
            return False
        return True

    def _pause_more(self) -> None:
        self._pause = min(max(2 * self._pause, DOWN_FIRST_S), DOWN_MAX_S)
        self._down_until = time.monotonic() + self._pause

    def _failed(self, error: Exception) -> None:
        """A store call raised: an outage (timeout, lost connection) pauses the store until
        the save thread's probe finds it back."""
        if not isinstance(error, OUTAGES):
            return
        self._pause_more()
        self._down = True
        log.warning("the KV store failed (%s: %s); requests recompute and saves are dropped "
                    "until it answers again (next try in %.0f s)", type(error).__name__, error,
                    self._pause)

    def _succeeded(self) -> None:
        if self._pause:
            log.info("the KV store answers again")
            self._pause = 0.0

    def _probe(self) -> None:
        """In the save thread, once a pause is over: is the store back? Any failure, not
        only an outage's (a daemon refusing UNAVAILABLE at its cap), waits a longer pause."""
        try:
            self.store.contains_n([_PROBE_HASH])
        except Exception:
            self._pause_more()
            return
        self._down = False  # (half-open: `_pause` kept until a real call succeeds)

    def num_prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` the store holds (0 if the store fails)."""
        if not hashes:
            return 0
        self.stats.lookups += 1
        if not self._store_up():
            return 0
        try:
            found = int(self.store.match_prefix(hashes).num_blocks)
        except Exception as e:  # a store outage means recompute, never a failed request
            self.stats.lookup_errors += 1
            self._failed(e)
            return 0
        self._succeeded()
        return found

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """Load blocks the store matched into cache blocks `block_ids`; returns the length of
        the loaded prefix (a block missing or corrupt on read ends it: a load miss)."""
        return self._load(hashes, block_ids, prefix=False)

    def load_prefix(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """`num_prefix_blocks` and `load` in one round trip (the store's `get_prefix_n`,
        `reads_prefix`): the longest stored prefix of `hashes` read into the first of
        `block_ids`; its length. The cache blocks past it hold nothing usable. 0 when the
        store fails (a lookup error)."""
        if not hashes:
            return 0
        self.stats.lookups += 1
        return self._load(hashes, block_ids, prefix=True)

    def _load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int], prefix: bool) -> int:
        n = len(hashes)
        if n == 0:
            return 0
        if not self.codec.is_raw:
            return self._load_encoded(hashes, block_ids, prefix)
        if self.kv_cache.device.type == "cpu":
            # straight into the cache blocks (each one contiguous): no staging copy. The
            # blocks are this request's fresh ones; any past the first miss get recomputed.
            dsts, staging = [self.kv_cache[i] for i in block_ids], None
        else:
            if self._staging.shape[0] < n:
                self._staging = self.kv_cache.new_empty((n, *self.kv_cache.shape[1:]))
            dsts = staging = self._staging[:n]  # [n, L, 2, bt, Hkv, D], contiguous
        good = self._get_prefix(hashes, dsts, prefix)
        if good and staging is not None:
            kernels.scatter_blocks(staging[:good], self.kv_cache, self._ids(block_ids[:good]),
                                   check_values=False)
        return self._counted(good, n, prefix)

    def _load_encoded(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
                      prefix: bool) -> int:
        """`load` of a compressed namespace: read into an encoded staging buffer, then decode
        the hit prefix straight into the cache blocks."""
        n = len(hashes)
        staging = self.codec.staging(n, self.kv_cache.device)
        good = self._get_prefix(hashes, staging, prefix)
        if good:
            try:
                good = self.codec.decode(staging[:good], self.kv_cache, self._ids(block_ids[:good]))
            except Exception:  # bytes no encoder of ours wrote: a miss, recomputed, never a
                self.stats.lookup_errors += 1  # failed request
                log.exception("decoding %d %s blocks from the store failed; recomputing them",
                              good, self.codec.name)
                good = None
        return self._counted(good, n, prefix)

    def _get_prefix(self, hashes: Sequence[BlockHash], dsts, prefix: bool) -> int | None:
        """Read into `dsts`: how many leading blocks hit (None when the store failed,
        counted as a lookup error, not as misses). `prefix`: the store stops at the first
        miss (get_prefix_n), else it reads them all (get_n)."""
        if not self._store_up():
            return None
        try:
            if prefix:
                found = int(self.store.get_prefix_n(hashes, dsts).num_blocks)
            else:
                found = leading_hits(self.store.get_n(hashes, dsts))
        except Exception as e:
            self.stats.lookup_errors += 1
            self._failed(e)
            return None
        self._succeeded()
        return found

    def _counted(self, good: int | None, n: int, prefix: bool) -> int:
        if good is None:
            return 0
        self.stats.loaded_blocks += good
        if not prefix:  # matched, then missing or corrupt (a prefix read matched nothing
            self.stats.load_misses += n - good  # past what it loaded)
        return good

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)

    def save(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        """Queue blocks for saving; returns at once (the copy out of the cache is done here):
        whether they were queued (not when the queue is full or the connector closed)."""
        if not hashes or self._closed:
            return False
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.shape != (len(hashes),):
            raise ValueError(f"save: {len(hashes)} hashes for {ids.size} block ids")
        n = self.kv_cache.shape[0]
        if ids.min() < 0 or ids.max() >= n:  # (clipped into range, another block's KV was
            bad = ids[(ids < 0) | (ids >= n)]  # stored under the hash)
            raise ValueError(f"save: block ids {bad[:8].tolist()} are outside the cache's "
                             f"{n} blocks")
        staged = self._gather(ids)  # [n, L, 2, bt, Hkv, D]
        try:
            self._queue.put_nowait((list(hashes), staged))
        except queue.Full:
            self.stats.save_dropped_blocks += len(hashes)
            return False
        return True

    def _gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks copied out of the cache. On CPU one single-threaded numpy gather over
        the raw bytes (torch's copies run on its intra-op pool, which spins for
        milliseconds on a busy host); on a device the gather kernel."""
        cache = self.kv_cache
        if cache.device.type != "cpu":
            ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
            return kernels.gather_blocks(cache, ids, check_values=False)
        staged = cache.new_empty((len(block_ids), *cache.shape[1:]))
        rows = cache.view(cache.shape[0], -1).view(torch.uint8).numpy()  # [num_blocks, bytes]
        out = staged.view(len(block_ids), -1).view(torch.uint8).numpy()
        np.take(rows, np.asarray(block_ids, dtype=np.int64), axis=0, out=out)  # (ids checked)
        return staged

    def _save_loop(self) -> None:
        while True:
            wait = None if not self._down else self._down_until - time.monotonic()
            try:
                item = self._queue.get(timeout=max(wait, 0.01)) if wait is not None else \
                    self._queue.get()
            except queue.Empty:
                self._probe()
                continue
            if wait is not None and wait <= 0 and item is not _STOP:
                self._probe()
            try:
                if item is _STOP:
                    return
                hashes, staged = item
                if not self._store_up():
                    self.stats.save_dropped_blocks += len(hashes)
                    continue
                try:
                    encoded, keep = self.codec.encode(staged)  # raw: the blocks as they are
                    if not all(keep):
                        self.stats.save_unencodable_blocks += keep.count(False)
                        hashes = [h for h, k in zip(hashes, keep) if k]
                        encoded = encoded[torch.tensor(keep)]
                    statuses = self.store.put_n(hashes, encoded)
                    refused = sum(1 for st in statuses if st is PutStatus.NO_SPACE)
                    self.stats.saved_blocks += len(hashes) - refused
                    self.stats.save_refused_blocks += refused
                    self._succeeded()
                except Exception as e:
                    self.stats.save_errors += len(hashes)
                    self._failed(e)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued save has reached the store (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Flush the pending saves and stop the save thread (the store stays open)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        # (not waiting out a probe of a store that does not answer: its timeout is the
        # client's, 30 s by default; the thread ends once the probe does)
        self._thread.join(None if not self._down else DOWN_FIRST_S)
