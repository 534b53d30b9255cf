"""The vLLM connector's two sides against a store that cannot answer (closed here: what a
daemon gone or hung raises is handled alike, STORE_OUTAGES): lookups find nothing, loads
come back as load errors vLLM recomputes, saves are skipped. Each raised, and failed vLLM's
scheduler or worker step, with every request in it. Plain state and a real store, no vLLM."""
import torch

from engine_adapter.plugins.vllm.metadata import BlockTransfer, KVTierMetadata
from engine_adapter.plugins.vllm.scheduler_side import SchedulerSide
from engine_adapter.plugins.vllm.worker_side import WorkerSide
from kvstore.config import StoreConfig, TierConfig
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks
from kvstore.store import TieredStore

NS = Namespace("outage", num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=4,
               dtype="float32")


def closed_store() -> TieredStore:
    store = TieredStore(NS, StoreConfig((TierConfig(TierKind.DRAM, 64),)))
    store.close()
    return store


def test_the_scheduler_side_finds_nothing_in_a_store_that_cannot_answer():
    side = SchedulerSide(NS, closed_store())
    assert side.lookup("r1", list(range(40)), 0) == (0, False)


def test_the_worker_side_loads_nothing_and_saves_nothing_without_failing_the_step():
    side = WorkerSide(NS, closed_store(), torch.float32)
    caches = {f"model.layers.{i}.attn": torch.zeros(2, 16, 4, 1, 8) for i in range(2)}
    side.register(caches)
    hashes = tuple(hash_blocks(NS, list(range(12))))
    meta = KVTierMetadata()
    meta.loads.append(BlockTransfer("r1", hashes, (3, 4, 5), False))
    side.start_load(meta)
    for name in caches:
        side.wait_layer(name)
    side.begin_step(KVTierMetadata(saves=[BlockTransfer("r2", hashes, (6, 7, 8), False)]))
    for name in caches:
        side.save_layer(name)
    side.finish_step(KVTierMetadata(saves=[BlockTransfer("r2", hashes, (6, 7, 8), False)]))
    assert side.loader.load_errors == {3, 4, 5} and side.num_loaded_blocks == 0
    assert side.num_saved_blocks == 0
