"""The router's cost model comes from what the workers measured, per role."""
import pytest

from engine_adapter.serving.costs import NO_LINK, describe, fit_cost_model
from engine_adapter.serving.protocol import Role, WorkerInfo
from kvstore.keys import Namespace
from kvstore.scheduler.cost_model import (DecodeCost, DecodeSample, FitError, LinkCost,
                                          PrefillCost, PrefillSample, TransferSample)

PREFILL = PrefillCost(0.05, 3e-3, 1e-6)
DECODE = DecodeCost(0.06, 0.01, 2e-5)
LINK = LinkCost(2e-4, 5e9)


def info(role: Role, prefill=True, decode=True, load=True) -> WorkerInfo:
    p = tuple(PrefillSample(n, c, PREFILL.time_s(n, c))
              for n, c in ((384, 0), (128, 0), (32, 0), (64, 1024)))
    d = tuple(DecodeSample(b, k, DECODE.step_s(b, k)) for b, k in ((1, 100), (1, 2000), (2, 1000)))
    t = tuple(TransferSample(n, LINK.time_s(n)) for n in (1 << 20, 8 << 20, 32 << 20))
    i = WorkerInfo("w", role, "m", 1, 64, 16, 2048, Namespace("m", 2, 2, 16), 1,
                   p if prefill else (), d if decode else (), t if load else ())
    return WorkerInfo.decode(i.encode())  # what the router has: the samples as they travel


def test_fits_each_part_from_the_workers_that_do_it():
    cost = fit_cost_model([info(Role.PREFILL, decode=False), info(Role.DECODE, prefill=False)], 16, 4096)
    assert cost.prefill.time_s(1000, 500) == pytest.approx(PREFILL.time_s(1000, 500), rel=1e-6)
    assert cost.decode.step_s(3, 5000) == pytest.approx(DECODE.step_s(3, 5000), rel=1e-6)
    assert cost.transfer.dram.bytes_per_s == pytest.approx(5e9, rel=1e-6)
    assert "pool reads 5.0 GB/s" in describe(cost)


def test_without_a_pool_nothing_is_priced_for_fetching():
    cost = fit_cost_model([info(Role.COLOCATED, load=False)], 16, 4096)
    assert cost.transfer.dram is NO_LINK and "no pool" in describe(cost)


def test_a_decode_worker_alone_cannot_price_prefills():
    with pytest.raises(FitError):
        fit_cost_model([info(Role.DECODE)], 16, 4096)
