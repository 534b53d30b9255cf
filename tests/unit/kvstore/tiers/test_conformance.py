"""One suite, every tier: the Tier contract from kvstore/tiers/base.py."""
import pytest
import torch

from kvstore.errors import StoreClosedError
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks
from kvstore.tiers.base import Tier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.ssd import SsdTier

NS = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
SLOTS = 6


@pytest.fixture(params=["gpu", "dram", "ssd"])
def tier(request, tmp_path):
    if request.param == "gpu":
        t = GpuTier(SLOTS, NS.block_bytes, device="cpu")
    elif request.param == "dram":
        t = DramTier(SLOTS, NS.block_bytes)
    else:
        t = SsdTier(NS, str(tmp_path / "ssd"), SLOTS)
    yield t
    t.close()


def _blocks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NS.block_bytes), dtype=torch.uint8, generator=g)


HASHES = hash_blocks(NS, list(range(4 * SLOTS)))


def test_is_a_tier(tier):
    assert isinstance(tier, Tier)
    assert tier.num_slots == SLOTS and tier.slot_bytes == NS.block_bytes
    assert tier.kind in TierKind


def test_alloc_free_accounting(tier):
    a = tier.alloc_n(4)
    assert len(set(a)) == 4 and all(0 <= s < SLOTS for s in a)
    assert tier.num_free() == SLOTS - 4
    assert tier.alloc_n(3) is None and tier.num_free() == SLOTS - 4  # all or nothing
    b = tier.alloc_n(2)
    assert not set(a) & set(b) and tier.num_free() == 0
    tier.free_n(a[:2], HASHES[:2])
    assert tier.num_free() == 2
    assert set(tier.alloc_n(2)) == set(a[:2])


@pytest.mark.parametrize("batched", [True, False])
def test_write_read_byte_exact(tier, batched):
    slots = tier.alloc_n(5)
    data = _blocks(5)
    tier.write_n(slots, HASHES[:5], data if batched else list(data))
    out = torch.zeros_like(data)
    assert tier.read_n(slots, HASHES[:5], out if batched else list(out)) == [True] * 5
    assert torch.equal(out, data)
    # a read of a subset in another order
    out2 = [torch.zeros(NS.block_bytes, dtype=torch.uint8) for _ in range(2)]
    assert tier.read_n([slots[3], slots[1]], [HASHES[3], HASHES[1]], out2) == [True, True]
    assert torch.equal(out2[0], data[3]) and torch.equal(out2[1], data[1])


def test_slot_view_holds_the_block(tier):
    slots = tier.alloc_n(2)
    data = _blocks(2)
    tier.write_n(slots, HASHES[:2], data)
    view = tier.slot_view(slots[1])  # (numpy in host memory, torch on a device)
    assert torch.equal(torch.as_tensor(view).reshape(-1), data[1])


def test_overwrite_after_free(tier):
    slots = tier.alloc_n(1)
    tier.write_n(slots, HASHES[:1], _blocks(1, seed=1))
    tier.free_n(slots, HASHES[:1])
    again = tier.alloc_n(1)
    tier.write_n(again, HASHES[1:2], _blocks(1, seed=2))
    out = torch.zeros(1, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(again, HASHES[1:2], out) == [True]
    assert torch.equal(out, _blocks(1, seed=2))


def test_closed_tier_refuses_work(tier):
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.alloc_n(1)
    with pytest.raises(StoreClosedError):
        tier.read_n([0], HASHES[:1], torch.zeros(1, NS.block_bytes, dtype=torch.uint8))
    tier.close()  # idempotent
