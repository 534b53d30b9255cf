"""No input hangs the engine: requests at and past the KV cache's size, preemption under a
full cache, and admission that does not stall behind a request that does not fit yet.

Every test here carries a timeout: a hang fails it instead of stalling the suite."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_adapter.config import EngineConfig, OversizePolicy
from engine_adapter.engine import LLMEngine
from engine_adapter.errors import InvalidRequestError
from engine_adapter.request import FinishReason, RequestStatus
from engine_adapter.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

BT = 4


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def config(num_blocks: int, **kw) -> EngineConfig:
    return EngineConfig(num_blocks=num_blocks, block_tokens=BT, max_num_batched_tokens=64, **kw)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy outputs of each prompt alone in a cache far larger than it needs."""
    engine = LLMEngine(tiny_model, config(256))
    memo = {}

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = engine.generate([prompt], greedy(max_tokens))[0].token_ids
        return memo[key]
    return run


def drain(engine: LLMEngine, max_steps: int = 10_000) -> int:
    """Step until nothing is left; the number of steps (bounded: a livelock fails)."""
    for step in range(max_steps):
        if not engine.has_unfinished:
            return step
        engine.step()
    raise AssertionError(f"still unfinished after {max_steps} steps")


def test_the_issue_request_is_refused_and_the_engine_keeps_serving(tiny_model, reference):
    # 5 blocks of 16: a 70-token prompt with max_tokens=20 needs a 6th block at token 81
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=5, block_tokens=16))
    with pytest.raises(InvalidRequestError, match=r"max_tokens \(20\).*6 KV blocks.*has 5.*to 11 or less"):
        engine.add_request(tokens(70, 1), greedy(20))
    small = engine.generate([tokens(5, 2)], greedy(8))[0]
    assert small.token_ids == reference(tokens(5, 2), 8)
    assert engine.pool.num_free == 5 and not engine.scheduler.waiting


def test_truncate_policy_ends_the_issue_request_with_length_and_serves_the_next(tiny_model, reference):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=5, block_tokens=16, oversize_policy="truncate"))
    big = engine.add_request(tokens(70, 1), greedy(20))
    small = engine.add_request(tokens(5, 2), greedy(8))
    drain(engine)
    # 80 tokens have K/V in 5 full blocks; the 81st was sampled from them and needs a 6th
    assert big.finish_reason is FinishReason.LENGTH and len(big.output_token_ids) == 11
    assert big.output_token_ids == reference(tokens(70, 1), 20)[:11]
    assert small.output_token_ids == reference(tokens(5, 2), 8)
    assert engine.pool.num_free == 5


@pytest.mark.parametrize("policy", list(OversizePolicy))
def test_a_request_that_exactly_fills_the_cache_runs_to_max_tokens(tiny_model, reference, policy):
    # 20 prompt + 13 outputs: the last output is never fed back, so 32 tokens = 8 blocks
    engine = LLMEngine(tiny_model, config(8, oversize_policy=policy))
    out = engine.generate([tokens(20, 3)], greedy(13))[0]
    assert out.finish_reason is FinishReason.LENGTH and out.token_ids == reference(tokens(20, 3), 13)
    assert engine.pool.num_free == 8


def test_one_token_over_is_refused_and_under_truncate_ends_one_short(tiny_model, reference):
    with pytest.raises(InvalidRequestError, match="9 KV blocks"):
        LLMEngine(tiny_model, config(8)).add_request(tokens(20, 3), greedy(14))
    engine = LLMEngine(tiny_model, config(8, oversize_policy="truncate"))
    out = engine.generate([tokens(20, 3)], greedy(14))[0]
    assert out.finish_reason is FinishReason.LENGTH and out.token_ids == reference(tokens(20, 3), 13)


@pytest.mark.parametrize("policy", list(OversizePolicy))
def test_a_prompt_that_fills_the_cache_alone_gets_one_token_and_a_longer_one_is_refused(tiny_model, reference, policy):
    engine = LLMEngine(tiny_model, config(8, oversize_policy=policy))
    out = engine.generate([tokens(32, 4)], greedy(1))[0]
    assert out.token_ids == reference(tokens(32, 4), 1)
    with pytest.raises(InvalidRequestError, match="the prompt needs 9 KV blocks"):
        engine.add_request(tokens(33, 4), greedy(1))


def test_a_resumed_request_counts_its_outputs(tiny_model):
    engine = LLMEngine(tiny_model, config(8))
    with pytest.raises(InvalidRequestError, match="the prompt needs 9"):
        engine.add_request(tokens(30, 5), greedy(10), output_token_ids=[1, 2, 3])
    engine.add_request(tokens(20, 5), greedy(13), output_token_ids=[1, 2, 3])  # 33 - 1 fit
    drain(engine)


@pytest.mark.parametrize("skips", [0, 8])
@pytest.mark.parametrize("policy", list(OversizePolicy))
def test_many_requests_each_filling_the_cache_all_finish_with_their_solo_outputs(tiny_model, reference, policy, skips):
    engine = LLMEngine(tiny_model, config(8, oversize_policy=policy, max_admission_skips=skips))
    prompts = [tokens(n, 10 + i) for i, n in enumerate((20, 8, 31, 14, 1, 25))]
    reqs = [engine.add_request(p, greedy(33 - len(p))) for p in prompts]
    victims = record_preemptions(engine)
    drain(engine)
    assert victims, "the cache was never full: this test drives nothing"
    for p, r in zip(prompts, reqs):
        assert r.output_token_ids == reference(p, 33 - len(p))
    assert engine.pool.num_free == 8 and not engine.requests


def record_preemptions(engine: LLMEngine) -> list:
    """Wrap the scheduler's preempt: check each victim is the newest running request and
    never the only one, and collect them."""
    victims, preempt = [], engine.scheduler.preempt

    def checked(req):
        running = engine.scheduler.running
        assert req is running[-1] and len(running) > 1, "preempted the oldest or a lone request"
        victims.append(req.request_id)
        preempt(req)
    engine.scheduler.preempt = checked
    return victims


def test_only_the_newest_request_is_preempted_and_the_oldest_runs_through(tiny_model, reference):
    engine = LLMEngine(tiny_model, config(6))
    old = engine.add_request(tokens(10, 20), greedy(13))    # grows to 22 tokens: 6 blocks
    new = engine.add_request(tokens(6, 21), greedy(6))
    victims = record_preemptions(engine)
    drain(engine)
    assert victims and set(victims) == {new.request_id}
    assert old.output_token_ids == reference(tokens(10, 20), 13)
    assert new.output_token_ids == reference(tokens(6, 21), 6)


def test_a_request_waiting_for_blocks_does_not_stall_smaller_ones_behind_it(tiny_model):
    engine = LLMEngine(tiny_model, config(10, max_admission_skips=2))
    hog = engine.add_request(tokens(20, 30), greedy(8))     # 5 blocks, then a 6th
    engine.step()
    big = engine.add_request(tokens(24, 31), greedy(4))     # 6 blocks: 4 are free
    smalls = [engine.add_request(tokens(3, 32 + i), greedy(2)) for i in range(3)]
    engine.step()
    assert big.status is RequestStatus.WAITING and engine.pool.num_free == 2
    # two small ones go ahead (the bound); the third would fit but waits behind big
    assert [s.status for s in smalls] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING]
    assert big.num_skips == 2
    drain(engine)
    assert all(r.finished for r in (hog, big, *smalls))


def test_strict_fcfs_admits_nothing_past_a_request_that_does_not_fit(tiny_model):
    engine = LLMEngine(tiny_model, config(10, max_admission_skips=0))
    engine.add_request(tokens(20, 30), greedy(8))
    engine.step()
    big = engine.add_request(tokens(24, 31), greedy(4))
    small = engine.add_request(tokens(3, 32), greedy(2))
    engine.step()
    assert big.status is small.status is RequestStatus.WAITING and engine.pool.num_free == 4
    drain(engine)
    assert big.finished and small.finished


def test_bad_policy_and_skip_values_are_refused():
    with pytest.raises(ValueError, match="oversize_policy must be one of"):
        EngineConfig(oversize_policy="drop")
    with pytest.raises(ValueError, match="max_admission_skips"):
        EngineConfig(max_admission_skips=-1)


workload = st.lists(st.tuples(st.integers(1, 34), st.integers(1, 40)), min_size=1, max_size=7)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload, st.integers(6, 12), st.integers(0, 3), st.sampled_from([4, 9, 64]))
def test_any_workload_ends_with_each_request_as_it_runs_alone(tiny_model, reference, reqs, num_blocks, skips, step_tokens):
    """Random prompt/max_tokens mixes (many past the cache) under TRUNCATE: every request
    ends, with the solo output cut where it would outgrow the whole cache."""
    cfg = EngineConfig(num_blocks=num_blocks, block_tokens=BT, max_num_batched_tokens=step_tokens,
                       max_num_seqs=4, oversize_policy="truncate", max_admission_skips=skips)
    engine = LLMEngine(tiny_model, cfg)
    cap = num_blocks * BT
    accepted = []
    for i, (n, m) in enumerate(reqs):
        p = tokens(n, 100 + i)
        if n > cap:
            with pytest.raises(InvalidRequestError):
                engine.add_request(p, greedy(m))
            continue
        accepted.append((p, m, engine.add_request(p, greedy(m))))
    drain(engine)
    for p, m, r in accepted:
        expected = reference(p, m)[:min(m, cap + 1 - len(p))]
        assert r.output_token_ids == expected
    assert engine.pool.num_free == num_blocks


@pytest.mark.parametrize("prompt", [[1.7, 2.2, 3.9], b"\x01\x02\x03", [True, False, True],
                                    [[1, 2], [3, 4]], [1.0, float("nan")], ["1", "2"]],
                         ids=["fractions", "bytes", "bools", "2-D", "NaN", "strings"])
def test_a_prompt_of_ids_that_are_not_integers_is_refused(tiny_model, reference, prompt):
    """[1.7, 2.2, 3.9] was served as [1, 2, 3], bytes and bools as ids, and a 2-D or NaN
    prompt raised a bare ValueError: each is refused, saying why, and the engine serves on
    (integral floats and integer tensors are ids as ever)."""
    engine = LLMEngine(tiny_model, config(64))
    with pytest.raises(InvalidRequestError, match="token ids|bytes|one sequence"):
        engine.add_request(prompt, greedy(2))
    assert not engine.has_unfinished
    ids = tokens(9, 4)
    want = reference(ids, 3)
    assert engine.generate([[float(t) for t in ids]], greedy(3))[0].token_ids == want
    assert engine.generate([torch.tensor(ids)], greedy(3))[0].token_ids == want


@pytest.mark.parametrize("weights,cache", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_an_engine_whose_cache_dtype_is_not_its_models_is_refused_at_once(weights, cache):
    """A float32 model with EngineConfig(dtype="bfloat16") was built, and failed at its
    first step with a kernel's dtype error; it is refused when made, saying what to do."""
    from engine_adapter.config import ModelConfig
    from engine_adapter.loader import random_model
    mc = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                     name="t")
    model = random_model(mc, dtype=weights)
    with pytest.raises(ValueError, match=f"weights are {weights} but EngineConfig.dtype is {cache}"):
        LLMEngine(model, EngineConfig(num_blocks=16, block_tokens=4, dtype=cache))
    engine = LLMEngine(model, EngineConfig(num_blocks=16, block_tokens=4, dtype=weights))
    assert len(engine.generate([[1, 2, 3, 4, 5]], greedy(2))[0].token_ids) == 2
