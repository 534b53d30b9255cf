"""Prefill in one process, decode in another, through one store: same tokens as colocated."""
import importlib.util
import os
import subprocess
import sys

import msgpack

from engine_adapter.engine import LLMEngine
from engine_adapter.loader import random_model
from engine_adapter.workers import DecodeWorker, Handoff, PrefillWorker, Worker
from kvstore.config import StoreConfig, TierConfig
from kvstore.store import TieredStore

HERE = os.path.dirname(__file__)
_spec = importlib.util.spec_from_file_location("prefill_child", os.path.join(HERE, "prefill_child.py"))
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)


def colocated():
    return Worker(LLMEngine(random_model(child.MODEL, seed=3), child.ENGINE)).generate(child.PROMPTS, child.PARAMS)


def test_in_process_prefill_to_decode_handoff():
    model = random_model(child.MODEL, seed=3)
    ns = LLMEngine(model, child.ENGINE).ns
    with TieredStore(ns, StoreConfig(tiers=(TierConfig("dram", 64),))) as store:
        prefill = LLMEngine(model, child.ENGINE, store=store)
        handoffs = PrefillWorker(prefill).prefill(child.PROMPTS, child.PARAMS)
        decode = LLMEngine(model, child.ENGINE, store=store)
        outs = DecodeWorker(decode).decode([Handoff.from_bytes(h.to_bytes()) for h in handoffs])
        prefill.close(), decode.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in colocated()]
    assert [o.num_loaded_tokens for o in outs] == [4, 16, 40]


def test_prefill_and_decode_in_separate_processes(tmp_path):
    store_dir, handoff_path = str(tmp_path / "ssd"), str(tmp_path / "handoffs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, os.path.join(HERE, "prefill_child.py"), store_dir, handoff_path],
                   check=True, timeout=120, env=env)
    with open(handoff_path, "rb") as f:
        handoffs = [Handoff.from_bytes(raw) for raw in msgpack.unpackb(f.read())]
    model = random_model(child.MODEL, seed=3)
    ns = LLMEngine(model, child.ENGINE).ns
    with TieredStore(ns, child.tiers(store_dir)) as store:
        decode = LLMEngine(model, child.ENGINE, store=store)
        outs = DecodeWorker(decode).decode(handoffs)
        decode.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in colocated()]
    assert [o.num_loaded_tokens for o in outs] == [4, 16, 40]
    assert [o.num_model_tokens for o in outs] == [3 + 8, 4 + 8, 1 + 8]  # tail + first token, then 8 decodes
