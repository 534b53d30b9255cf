"""Small random-weight models and engines for the engine unit tests."""
import pytest
import torch

from engine_adapter.config import EngineConfig, ModelConfig
from engine_adapter.loader import random_model

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                   name="tiny-random-seed0")


@pytest.fixture(scope="session")
def tiny_model():
    return random_model(TINY, seed=0)


@pytest.fixture
def engine_config():
    return EngineConfig(num_blocks=64, block_tokens=4, max_num_batched_tokens=64)


@pytest.fixture
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 40, 33)]
