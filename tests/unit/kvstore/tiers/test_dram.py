import os
import subprocess
import sys

import pytest
import torch

from kvstore.errors import ConfigError, StoreClosedError
from kvstore.keys import Namespace, hash_blocks
from kvstore.tiers.dram import DramArenaReader, DramTier

NS = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
HASHES = hash_blocks(NS, list(range(40)))


def _blocks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NS.block_bytes), dtype=torch.uint8, generator=g)


def test_arena_lives_in_dev_shm_and_goes_at_close():
    tier = DramTier(4, NS.block_bytes)
    path = f"/dev/shm/{tier.shm_name}"
    assert os.path.getsize(path) >= 4 * NS.block_bytes
    tier.close()
    assert not os.path.exists(path)


def test_a_taken_name_is_a_clear_error():
    tier = DramTier(2, NS.block_bytes)
    with pytest.raises(ConfigError, match="already exists"):
        DramTier(2, NS.block_bytes, shm_name=tier.shm_name)
    tier.close()


def test_another_process_maps_the_arena_and_reads_a_slot_byte_exact():
    tier = DramTier(4, NS.block_bytes)
    slots = tier.alloc_n(3)
    data = _blocks(3)
    tier.write_n(slots, HASHES[:3], data)
    code = ("import sys, xxhash; from kvstore.tiers.dram import DramArenaReader; "
            "r = DramArenaReader(sys.argv[1]); b = r.read(int(sys.argv[2])); "
            "print(r.slot_bytes, xxhash.xxh3_64_hexdigest(b)); r.close()")
    out = subprocess.run([sys.executable, "-c", code, tier.shm_name, str(slots[2])],
                         capture_output=True, text=True, check=True).stdout.split()
    import xxhash
    assert out == [str(NS.block_bytes), xxhash.xxh3_64_hexdigest(data[2].numpy().tobytes())]
    tier.close()


def test_reader_errors():
    with pytest.raises(ConfigError, match="is the store running"):
        DramArenaReader("kvtier-does-not-exist")
    tier = DramTier(2, NS.block_bytes)
    reader = DramArenaReader(tier.shm_name)
    with pytest.raises(IndexError):
        reader.read(2)
    reader.close()
    with pytest.raises(StoreClosedError):
        reader.read(0)
    tier.close()
