"""The module-shared pooled cluster (store node + 1 prefill + 2 decode workers + front end)
and the in-process greedy oracle."""
from __future__ import annotations

import pytest

from .cluster_proc import Cluster


@pytest.fixture(scope="module")
def cluster():
    c = Cluster("--prefill", "1", "--decode", "2", "--num-blocks", "256", "--worker-timeout", "4")
    try:
        yield c.wait_ready()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference():
    """Our engine on SmolLM2 in this process, no store: the greedy oracle."""
    from engine_adapter import EngineConfig, LLMEngine, load_smollm2
    model, tokenizer = load_smollm2()
    engine = LLMEngine(model, EngineConfig(num_blocks=256), tokenizer=tokenizer)
    yield engine
    engine.close()
