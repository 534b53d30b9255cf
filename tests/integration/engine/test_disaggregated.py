"""Prefill in one process, decode in another, through one store (in-process, reopened SSD,
or a real `kvtier serve` daemon): same tokens as colocated, and the decode side loads the
prompt's blocks instead of recomputing them."""
import importlib.util
import os
import subprocess
import sys

import msgpack
import pytest

from engine_adapter.engine import LLMEngine
from engine_adapter.loader import random_model
from engine_adapter.workers import DecodeWorker, Handoff, PrefillWorker, Worker
from kvstore.client import Client
from kvstore.config import StoreConfig, TierConfig
from kvstore.store import TieredStore

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = _load("prefill_child", os.path.join(HERE, "prefill_child.py"))
daemon_conftest = _load("daemon_conftest", os.path.join(ROOT, "tests", "integration", "daemon", "conftest.py"))
LOADED = [4, 16, 40]                 # the full blocks of each prompt (block_tokens=4)
MODEL_TOKENS = [3 + 8, 4 + 8, 1 + 8]  # partial tail + first token, then 8 more decodes (max_tokens=10)


def colocated(params):
    return Worker(LLMEngine(random_model(child.MODEL, seed=3), child.ENGINE)).generate(child.PROMPTS, params)


def run_prefill_child(where: str, handoff_path: str) -> list[Handoff]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, os.path.join(HERE, "prefill_child.py"), where, handoff_path],
                   check=True, timeout=120, env=env)
    with open(handoff_path, "rb") as f:
        return [Handoff.decode(raw) for raw in msgpack.unpackb(f.read())]


def decode_both_passes(model, store, handoffs):
    """Decode the seeded pass, then the greedy one, each on a fresh engine (so every prefix
    must come from the store, not from the decode engine's own paged cache)."""
    n = len(child.PROMPTS)
    outs = []
    for part in (handoffs[:n], handoffs[n:]):
        decode = LLMEngine(model, child.ENGINE, store=store)
        outs.append(DecodeWorker(decode).decode(part))
        decode.close()
    return outs


def assert_like_colocated(seeded, greedy):
    assert [o.token_ids for o in seeded] == [o.token_ids for o in colocated(child.PARAMS)]
    assert [o.token_ids for o in greedy] == [o.token_ids for o in colocated(child.GREEDY)]
    for outs in (seeded, greedy):
        assert [o.num_loaded_tokens for o in outs] == LOADED
        assert [o.num_local_hit_tokens for o in outs] == [0, 0, 0]
    assert [o.num_model_tokens for o in seeded] == MODEL_TOKENS
    assert [o.num_model_tokens for o in greedy] == [t + 2 for t in MODEL_TOKENS]  # max_tokens=12


def test_in_process_prefill_to_decode_handoff():
    model = random_model(child.MODEL, seed=3)
    ns = LLMEngine(model, child.ENGINE).ns
    with TieredStore(ns, StoreConfig(tiers=(TierConfig("dram", 64),))) as store:
        prefill = LLMEngine(model, child.ENGINE, store=store)
        handoffs = [Handoff.decode(h.encode()) for params in (child.PARAMS, child.GREEDY)
                    for h in PrefillWorker(prefill).prefill(child.PROMPTS, params)]
        prefill.close()
        assert_like_colocated(*decode_both_passes(model, store, handoffs))


def test_prefill_and_decode_in_separate_processes(tmp_path):
    store_dir = str(tmp_path / "ssd")
    handoffs = run_prefill_child(store_dir, str(tmp_path / "handoffs"))
    model = random_model(child.MODEL, seed=3)
    ns = LLMEngine(model, child.ENGINE).ns
    with TieredStore(ns, child.tiers(store_dir)) as store:
        assert_like_colocated(*decode_both_passes(model, store, handoffs))


@pytest.fixture
def kvtier_daemon(tmp_path):
    d = daemon_conftest.Daemon(str(tmp_path / "daemon-data"))
    d.start()
    yield d
    d.close()


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "tcp"])
def test_prefill_and_decode_processes_share_one_kvtier_daemon(tmp_path, kvtier_daemon, use_shm):
    """The prefill child publishes through its own Client; this process decodes through
    another: the only thing the two share is the daemon (and the handoff bytes)."""
    handoffs = run_prefill_child(kvtier_daemon.url, str(tmp_path / "handoffs"))
    model = random_model(child.MODEL, seed=3)
    ns = LLMEngine(model, child.ENGINE).ns
    with Client(kvtier_daemon.url, namespace=ns, use_shm=use_shm) as client:
        assert client.uses_shm is use_shm
        hashes = [h for handoff in handoffs for h in handoff.block_hashes]
        assert all(client.contains_n(hashes))  # published before the handoff was written
        before = client.stats()
        seeded, greedy = decode_both_passes(model, client, handoffs)
        after = client.stats()
    assert_like_colocated(seeded, greedy)
    hits = sum(t.counters.hits for t in after.tiers) - sum(t.counters.hits for t in before.tiers)
    assert hits == 2 * sum(LOADED) // child.ENGINE.block_tokens  # the daemon served every block
