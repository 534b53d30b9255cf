"""int8 KV blocks on SmolLM2-135M stay within issue 18's quality bounds: our engine saves a
prompt's blocks through its connector into an int8 store (and, for the baseline, a raw
one); those blocks, read back and decoded, are the prefix of a transformers forward of the
raw run's own greedy continuation (teacher forcing, as bench/compression.py does on 32
prompts); top-1 agreement >= 0.99, mean KL <= 0.001 nats/token and NLL within 1% of the
raw blocks'. (Fed the text itself instead, near-ties flip more: 253 of 256 agreed.)"""
import heapq
import inspect
import json
import textwrap

import pytest
import torch

from engine_adapter import kvquality
from engine_adapter.config import EngineConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.plugins.base import coded
from engine_adapter.sampling import SamplingParams
from kvstore.config import StoreConfig, TierConfig
from kvstore.keys import hash_blocks
from kvstore.store import TieredStore

PREFIX_BLOCKS = 25     # 400 tokens of KV from the store (+ 1 prompt token computed)
NEW_TOKENS = 32        # the raw run's greedy continuation, fed back


def prompts(tokenizer) -> list[list[int]]:
    """Four public texts that ship with Python: the sources of stdlib modules (docstring
    first), as bench/compression.py uses on a larger scale."""
    return [tokenizer(inspect.getsource(m))["input_ids"][:PREFIX_BLOCKS * 16 + 1]
            for m in (json.decoder, json.encoder, textwrap, heapq)]


def run_saving(model, codec: str, prompt: list[int], max_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Run the prompt greedily through our engine with a store of `codec`: the prefix's
    blocks as the store gives them back (decoded), and the generated tokens."""
    cfg = EngineConfig(num_blocks=64, kv_codec=codec, enable_prefix_caching=False)
    ns = LLMEngine(model, EngineConfig(num_blocks=1, kv_codec=codec)).ns
    with TieredStore(ns, StoreConfig((TierConfig("dram", 64),))) as store:
        engine = LLMEngine(model, cfg, store=store)
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       ignore_eos=True))[0]
        engine.close()
        blocks = torch.empty((PREFIX_BLOCKS, *ns.block_shape))
        found = coded(store, ns).get_n(hash_blocks(ns, prompt[:PREFIX_BLOCKS * 16]), blocks)
    assert None not in found and engine.connector.stats.saved_blocks >= PREFIX_BLOCKS
    return blocks, out.token_ids


@pytest.mark.timeout(900)  # the real model on a shared 2-core machine
def test_int8_blocks_keep_smollm2_within_the_quality_bounds(smollm2):
    hf, ours, tokenizer = smollm2
    total = kvquality.Quality(0, 0, 0.0, 0.0, 0.0)
    for prompt in prompts(tokenizer):
        raw_blocks, cont = run_saving(ours, "raw", prompt, NEW_TOKENS)
        int8_blocks, _ = run_saving(ours, "int8", prompt, 1)
        feed = torch.tensor(prompt[PREFIX_BLOCKS * 16:] + cont[:-1])
        raw = kvquality.prefix_logits(hf, raw_blocks, feed)
        int8 = kvquality.prefix_logits(hf, int8_blocks, feed)
        total = total + kvquality.compare(raw, int8, torch.tensor(cont))
    assert total.num_tokens == 4 * NEW_TOKENS
    assert total.agreement >= 0.99, total
    assert 0 < total.mean_kl <= 0.001, total          # not lossless, and close
    assert abs(total.nll_change) <= 0.01, total
