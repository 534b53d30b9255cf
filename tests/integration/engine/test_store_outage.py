"""The engine beside a store that stops answering (SIGSTOP: alive, silent): the first
request that meets the outage waits one client timeout, the ones after it recompute at
once, close() does not wait a timeout per queued save, and once the store answers again
the engine saves to and loads from it as before. Output is the no-cache output throughout."""
from __future__ import annotations

import os
import signal
import time

import torch

from engine_adapter.config import EngineConfig, ModelConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.loader import random_model
from engine_adapter.sampling import SamplingParams
from kvstore.client import Client
from kvstore.daemon.process import freeze

from ..daemon.conftest import make_daemon  # noqa: F401  (the fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_a_stalled_store_costs_one_timeout_not_one_per_request(make_daemon):  # noqa: F811
    mc = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                     name="outage")
    model = random_model(mc, seed=3)
    cfg = EngineConfig(num_blocks=128, block_tokens=4, max_num_batched_tokens=256)
    prompts = [torch.randint(0, 300, (41,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(6)]
    expect = [LLMEngine(model, cfg).generate([p], GREEDY)[0].token_ids for p in prompts]
    d = make_daemon(dram_size="4MiB", ssd_size="0")
    store = Client(d.url, namespace=LLMEngine(model, cfg).ns, use_shm=False, timeout_s=1.0)
    engine = LLMEngine(model, cfg, store=store)
    took = []
    freeze(d.pid)
    try:
        for i in range(4):
            t0 = time.monotonic()
            assert engine.generate([prompts[i]], GREEDY)[0].token_ids == expect[i]
            took.append(time.monotonic() - t0)
    finally:
        os.kill(d.pid, signal.SIGCONT)
    # one request at most waits out the timeout (the first to meet the outage, or none when
    # the save thread met it first); before the breaker each waited 1 s (30 by default)
    assert sorted(took)[-2] < 0.5, took
    deadline = time.monotonic() + 20
    while engine.connector.store_down:
        assert time.monotonic() < deadline, "the store was never tried again"
        time.sleep(0.1)
    for i in (4, 5):
        assert engine.generate([prompts[i]], GREEDY)[0].token_ids == expect[i]
    engine.connector.flush()
    again = LLMEngine(model, cfg, store=store)
    out = again.generate([prompts[5]], GREEDY)[0]
    assert out.token_ids == expect[5] and out.num_loaded_tokens == 40
    t0 = time.monotonic()
    engine.close()
    again.close()
    assert time.monotonic() - t0 < 0.9
    store.close()
