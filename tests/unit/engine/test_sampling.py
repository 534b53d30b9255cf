"""Sampling: greedy, temperature, top-k, top-p, seeds; parameter validation."""
import pytest
import torch

from engine_adapter.errors import InvalidRequestError
from engine_adapter.sampling import SamplingParams, sample

LOGITS = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]] * 4)


def draws(params, n=200):
    gen = params.make_generator()
    return [sample(LOGITS[:1], [params], [gen])[0] for _ in range(n)]


def test_greedy_takes_the_argmax():
    p = SamplingParams(temperature=0)
    assert sample(LOGITS, [p] * 4, [None] * 4) == [1] * 4


def test_a_seed_makes_sampling_repeatable_and_seeds_differ():
    p = SamplingParams(temperature=1.0, seed=7)
    assert draws(p) == draws(p)
    assert draws(p) != draws(SamplingParams(temperature=1.0, seed=8))
    assert set(draws(p)) == {0, 1, 2, 3, 4}


def test_top_k_and_top_p_restrict_the_candidates():
    assert set(draws(SamplingParams(top_k=2, seed=1))) == {1, 2}
    assert set(draws(SamplingParams(top_k=1, seed=1))) == {1}
    assert set(draws(SamplingParams(top_p=0.01, seed=1))) == {1}  # just the top token
    # p(1) + p(2) ~ 0.86: top_p 0.8 needs both, never a third
    assert set(draws(SamplingParams(top_p=0.8, seed=1))) == {1, 2}


def test_low_temperature_concentrates():
    cold = draws(SamplingParams(temperature=0.05, seed=3))
    assert cold.count(1) > 0.8 * len(cold)


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(max_tokens=-1), dict(temperature=-0.1),
                                dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(stop=("",))])
def test_bad_parameters_raise(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_unknown_parameter_is_an_error():
    with pytest.raises(InvalidRequestError, match="frequency_penalty"):
        SamplingParams.from_dict({"temperature": 0.5, "frequency_penalty": 1.0})
    assert SamplingParams.from_dict({"stop": "x"}).stop == ("x",)


def test_a_seeded_row_draws_the_same_alone_and_in_a_mixed_batch():
    vocab = 64
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, seed=1),
              SamplingParams(temperature=1.3, top_p=0.6, seed=2), SamplingParams(top_k=3, top_p=0.5, seed=3),
              SamplingParams(temperature=0.9, seed=4)]

    def run(rows):
        gens = {i: params[i].make_generator() if not params[i].greedy else None for i in rows}
        return [sample(logits[rows], [params[i] for i in rows], [gens[i] for i in rows]) for _ in range(30)]

    together = run([0, 1, 2, 3, 4])
    for i in range(5):
        assert [draw[0] for draw in run([i])] == [draw[i] for draw in together]
    assert {d[0] for d in together} == {int(logits[0].argmax())}
    assert {d[1] for d in together} <= set(logits[1].topk(5).indices.tolist())
    assert {d[3] for d in together} <= set(logits[3].topk(3).indices.tolist())


def test_a_temperature_that_is_not_a_number_is_refused_and_a_tiny_one_is_greedy():
    """1e-50 and NaN passed the `< 0` check; the sampler divided the logits into inf and
    NaN, torch.multinomial raised inside engine.step(), and in a worker that ended its
    engine thread: every request after it hung."""
    import math

    from engine_adapter.errors import InvalidRequestError
    from engine_adapter.sampling import SamplingParams
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(InvalidRequestError, match="temperature"):
            SamplingParams(temperature=bad)
    assert SamplingParams(temperature=1e-50).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_a_failed_engine_step_fails_its_requests_and_the_loop_serves_on():
    import threading

    from engine_adapter.config import EngineConfig, ModelConfig
    from engine_adapter.engine import LLMEngine
    from engine_adapter.loader import random_model
    from engine_adapter.sampling import SamplingParams
    from engine_adapter.serving.engine_loop import EngineLoop
    mc = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                     name="loop")
    engine = LLMEngine(random_model(mc, seed=3),
                       EngineConfig(num_blocks=64, block_tokens=4, max_num_batched_tokens=256))
    real, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a kernel failed")
        return real()
    engine.step = step
    loop = EngineLoop(engine)
    try:
        results, done = {}, {name: threading.Event() for name in ("first", "second")}

        def callback(name):
            def f(req, err):
                if err is not None or req.finished:
                    results[name] = err if err is not None else req.output_token_ids
                    done[name].set()
            return f
        loop.submit("first", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3),
                    callback("first"))
        assert done["first"].wait(30)
        assert isinstance(results["first"], RuntimeError)
        loop.submit("second", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3),
                    callback("second"))
        assert done["second"].wait(30) and len(results["second"]) == 3
    finally:
        loop.close()
