"""Cost model: validation, shape, and fitting recovers known parameters."""
import numpy as np
import pytest

from kvstore.events import TierKind
from kvstore.scheduler.cost_model import (DecodeCost, DecodeSample, FitError, LinkCost,
                                          PrefillCost, PrefillSample, TransferSample,
                                          fit_decode, fit_link, fit_prefill, llama2_70b_like)


def test_prefill_cost_grows_with_prefix_and_new_tokens():
    cost = llama2_70b_like().prefill
    assert cost.time_s(1000, 8000) > cost.time_s(1000, 0)
    assert cost.time_s(9000, 0) > cost.time_s(1000, 8000)  # a cached prefix saves time


def test_invalid_parameters_raise():
    with pytest.raises(ValueError):
        PrefillCost(-1.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        LinkCost(0.0, 0.0)
    with pytest.raises(ValueError):
        DecodeCost(float("nan"), 0.0, 0.0)


def test_fetch_time_by_tier():
    cost = llama2_70b_like()
    dram = cost.transfer.fetch_s([TierKind.DRAM] * 4, cost.block_bytes)
    ssd = cost.transfer.fetch_s([TierKind.SSD] * 4, cost.block_bytes)
    assert 0 < dram < ssd
    assert cost.transfer.fetch_s([], cost.block_bytes) == 0.0


def test_fit_prefill_recovers_parameters():
    truth = PrefillCost(0.03, 1.5e-4, 3e-9)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(200):
        n, p = int(rng.integers(100, 60_000)), int(rng.integers(0, 60_000))
        samples.append(PrefillSample(n, p, truth.time_s(n, p) * rng.normal(1, 0.01)))
    fitted = fit_prefill(samples)
    assert fitted.per_token_s == pytest.approx(truth.per_token_s, rel=0.05)
    assert fitted.per_token_pair_s == pytest.approx(truth.per_token_pair_s, rel=0.05)
    assert fitted.base_s == pytest.approx(truth.base_s, abs=0.03)


def test_fit_decode_recovers_parameters():
    truth = DecodeCost(0.012, 2e-4, 4e-8)
    samples = [DecodeSample(b, k, truth.step_s(b, k))
               for b in (1, 8, 32, 128) for k in (1_000, 100_000, 900_000)]
    fitted = fit_decode(samples)
    for field in ("base_s", "per_seq_s", "per_kv_token_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6)


def test_fit_link_recovers_bandwidth():
    truth = LinkCost(2e-4, 12e9)
    samples = [TransferSample(n, truth.time_s(n)) for n in (2**16, 2**20, 2**24, 2**28)]
    fitted = fit_link(samples)
    assert fitted.bytes_per_s == pytest.approx(12e9, rel=1e-6)
    assert fitted.latency_s == pytest.approx(2e-4, rel=1e-4)


def test_fit_decode_of_one_batch_size_folds_the_sequence_cost_into_the_base():
    truth = DecodeCost(0.05, 0.01, 2e-5)
    samples = [DecodeSample(1, k, truth.step_s(1, k)) for k in (100, 1000, 2000)]
    fitted = fit_decode(samples)
    assert fitted.per_seq_s == 0 and fitted.base_s == pytest.approx(0.06, rel=1e-6)
    assert fitted.step_s(1, 1500) == pytest.approx(truth.step_s(1, 1500), rel=1e-6)


def test_fit_rejects_degenerate_samples():
    with pytest.raises(FitError):
        fit_prefill([PrefillSample(100, 0, 0.1)])
    with pytest.raises(FitError):
        fit_decode([DecodeSample(4, 1000, 0.02)] * 10)  # nothing varies
    with pytest.raises(FitError):
        fit_link([TransferSample(1000, 0.5), TransferSample(2000, 0.1)])  # faster if larger
