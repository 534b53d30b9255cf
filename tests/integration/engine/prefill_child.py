"""Child process of the disaggregation tests: prefill prompts, publish their blocks, write
the handoffs. argv: store handoff_path, where store is an SSD directory (an in-process
TieredStore) or a `kvtier://HOST:PORT` daemon (through kvstore.Client)."""
import sys

import msgpack

from engine_adapter.config import EngineConfig, ModelConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.loader import random_model
from engine_adapter.sampling import SamplingParams
from engine_adapter.workers import PrefillWorker
from kvstore.client import Client
from kvstore.config import StoreConfig, TierConfig
from kvstore.store import TieredStore

MODEL = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, name="disagg-random-seed3")
ENGINE = EngineConfig(num_blocks=128, block_tokens=4)
PARAMS = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(7 * i + j * j) % 512 for j in range(n)] for i, n in enumerate((6, 19, 40))]


def tiers(path):
    return StoreConfig(tiers=(TierConfig("dram", 64), TierConfig("ssd", 256, path=path)))


def open_store(where: str, ns):
    if where.startswith("kvtier://"):
        return Client(where, namespace=ns)
    return TieredStore(ns, tiers(where))


def main(where: str, handoff_path: str) -> None:
    engine = LLMEngine(random_model(MODEL, seed=3), ENGINE)
    handoffs = []
    with open_store(where, engine.ns) as store:
        engine = LLMEngine(engine.model, ENGINE, store=store)
        for params in (PARAMS, GREEDY):
            # fresh ids per pass: a request id is free again once its request finished
            handoffs += PrefillWorker(engine).prefill(PROMPTS, params)
        engine.close()
    with open(handoff_path, "wb") as f:
        f.write(msgpack.packb([h.encode() for h in handoffs]))


if __name__ == "__main__":
    main(*sys.argv[1:])
