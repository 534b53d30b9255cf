import os
import subprocess
import sys

import pytest
import torch

from kvstore.errors import ConfigError, StoreClosedError
from kvstore.keys import Namespace, hash_blocks
from kvstore.arena_layout import DramArenaReader
from kvstore.tiers.dram import DramTier

NS = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
HASHES = hash_blocks(NS, list(range(40)))


def _blocks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NS.block_bytes), dtype=torch.uint8, generator=g)


def test_the_arena_has_no_name_anywhere():
    before = set(os.listdir("/dev/shm"))
    tier = DramTier(4, NS.block_bytes)
    assert set(os.listdir("/dev/shm")) == before
    maps = open("/proc/self/maps").read()
    assert "memfd:kvtier-arena" in maps  # anonymous shared memory, not a file
    tier.close()


def test_another_process_maps_the_shared_arena_and_reads_a_slot_byte_exact():
    tier = DramTier(4, NS.block_bytes)
    slots = tier.alloc_n(3)
    data = _blocks(3)
    tier.write_n(slots, HASHES[:3], data)
    arena_fd, dir_fd = tier.share_fds()
    code = ("import sys, xxhash; from kvstore.arena_layout import DramArenaReader; "
            "r = DramArenaReader(int(sys.argv[1])); b = r.read(int(sys.argv[2])); "
            "print(r.slot_bytes, xxhash.xxh3_64_hexdigest(b), r.arena_id.hex()); r.close()")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(arena_fd), str(slots[2])],
                             capture_output=True, text=True, check=True,
                             pass_fds=(arena_fd,)).stdout.split()
    finally:
        os.close(arena_fd)
        os.close(dir_fd)
    import xxhash
    assert out == [str(NS.block_bytes), xxhash.xxh3_64_hexdigest(data[2].numpy().tobytes()),
                   tier.arena_id.hex()]
    tier.close()


def test_a_client_cannot_resize_the_shared_arena():
    tier = DramTier(2, NS.block_bytes)
    arena_fd, dir_fd = tier.share_fds()
    try:
        with pytest.raises(OSError):  # sealed: shrinking it would SIGBUS the store
            os.ftruncate(arena_fd, 0)
    finally:
        os.close(arena_fd)
        os.close(dir_fd)
        tier.close()


def test_reader_errors(tmp_path):
    bogus = tmp_path / "not-an-arena"
    bogus.write_bytes(b"\0" * 8192)
    with pytest.raises(ConfigError, match="not a kvtier DRAM arena"):
        DramArenaReader(os.open(bogus, os.O_RDONLY))
    tier = DramTier(2, NS.block_bytes)
    arena_fd, dir_fd = tier.share_fds()
    os.close(dir_fd)
    reader = DramArenaReader(arena_fd)
    with pytest.raises(IndexError):
        reader.read(2)
    reader.close()
    with pytest.raises(StoreClosedError):
        reader.read(0)
    tier.close()
