"""EngineConfig.max_prefill_chunk_tokens: a long prefill computes a chunk per step and
leaves the rest of the step to others, without changing what anyone generates."""
import torch

from engine_adapter.config import EngineConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def steps_to_first_token(engine, long, short):
    """Add `long`, let it start, add `short`; the step count at which each has a token."""
    a = engine.add_request(long, GREEDY)
    engine.step()
    b = engine.add_request(short, GREEDY)
    first, n = {}, 1
    while not (a.finished and b.finished):
        engine.step()
        n += 1
        for r in (a, b):
            if r.output_token_ids and r.request_id not in first:
                first[r.request_id] = n
    return first[a.request_id], first[b.request_id], a.output_token_ids, b.output_token_ids


def test_a_short_prompt_gets_its_token_while_a_long_one_still_prefills(tiny_model):
    g = torch.Generator().manual_seed(3)
    long = torch.randint(0, 512, (192,), generator=g).tolist()  # 3 whole budgets
    short = long[:8][::-1]
    whole = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_tokens=4,
                                               max_num_batched_tokens=64))
    chunked = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_tokens=4,
                                                 max_num_batched_tokens=64,
                                                 max_prefill_chunk_tokens=16))
    long_w, short_w, out_long_w, out_short_w = steps_to_first_token(whole, long, short)
    long_c, short_c, out_long_c, out_short_c = steps_to_first_token(chunked, long, short)
    assert short_w > long_w          # whole-budget chunks: the short prompt waits its turn
    assert short_c < long_c          # capped chunks: it runs beside the long prefill
    assert (out_long_c, out_short_c) == (out_long_w, out_short_w)
