"""The SSD tier against a dict model across crashes: random puts, evictions, removes,
group writes of the index and process deaths (the tier dropped with its index queue
unwritten, as SIGKILL leaves it: payloads and headers in the page cache, RocksDB with the
writes its WAL took). After every death, the reopened tier holds exactly the blocks the
model holds, each byte-exact: no acknowledged put lost, no freed or removed block back."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kvstore.keys import Namespace, hash_blocks
from kvstore.tiers import ssdindex
from kvstore.tiers.ssd import SsdTier

NS = Namespace("m", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=4)
HASHES = hash_blocks(NS, list(range(4 * 200)))
SLOTS = 8


def _block(i: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(i).integers(0, 256, NS.block_bytes,
                                                              dtype=np.uint8))


def _die(tier: SsdTier) -> None:
    """What SIGKILL leaves: nothing queued is written, nothing is flushed."""
    tier._closed = True
    tier.index._queue.clear()
    db, tier.index._db = tier.index._db, None
    db.close()  # (durable: every write RocksDB took is in its WAL already)
    tier.slabs.close()


def _reopen(path: str) -> tuple[SsdTier, dict[bytes, int]]:
    tier = SsdTier(NS, path, SLOTS, durable=True)
    return tier, dict(tier.recover())


def _check(tier: SsdTier, found: dict[bytes, int], model: dict[bytes, int]) -> None:
    assert set(found) == set(model)
    if not model:
        return
    hs = list(model)
    out = torch.zeros(len(hs), NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[h] for h in hs], hs, out) == [True] * len(hs)
    for row, h in zip(out, hs):
        assert torch.equal(row, _block(model[h]))


OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(1, 4)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("remove"), st.integers(0, 7)),
    st.tuples(st.just("persist"), st.just(0)),
    st.tuples(st.just("die"), st.just(0)),
), min_size=1, max_size=40)


@pytest.mark.parametrize("group", [1, 3, 256])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_what_a_reopened_tier_holds_is_what_was_stored(tmp_path_factory, monkeypatch, group, ops):
    monkeypatch.setattr(ssdindex, "GROUP_OPS", group)
    path = str(tmp_path_factory.mktemp("ssd"))
    tier, found = _reopen(path)
    model: dict[bytes, int] = {}  # hash -> the block number whose bytes it holds
    slots: dict[bytes, int] = {}
    fresh = iter(range(len(HASHES)))
    for op, arg in ops:
        if op == "put":
            got = tier.alloc_n(min(arg, tier.num_free()))
            if not got:
                continue
            nums = [next(fresh) for _ in got]
            hs = [HASHES[k] for k in nums]
            tier.write_n(got, hs, torch.stack([_block(k) for k in nums]))
            model.update(zip(hs, nums))
            slots.update(zip(hs, got))
        elif op in ("free", "remove") and model:
            h = list(model)[arg % len(model)]
            tier.free_n([slots.pop(h)], [h])
            del model[h]
            if op == "remove":  # the store's remove_n: persisted before it returns
                tier.persist_frees()
        elif op == "persist":
            tier.persist_frees()
        elif op == "die":
            _die(tier)
            tier, found = _reopen(path)
            _check(tier, found, model)
            slots = dict(found)
    tier.close()
    tier, found = _reopen(path)
    _check(tier, found, model)
    tier.close()
