import os
import subprocess
import sys
import textwrap

import torch

from kvstore.keys import Namespace, hash_blocks
from kvstore.layout import HEADER_BYTES, decode_block
from kvstore.tiers.ssd import SsdTier

NS = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
HASHES = hash_blocks(NS, list(range(40)))


def _blocks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NS.block_bytes), dtype=torch.uint8, generator=g)


def test_values_are_encoded_blocks_with_checksums(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4)
    tier.write_n(tier.alloc_n(2), HASHES[:2], _blocks(2))
    value = tier.raw_db()[bytes(HASHES[1])]
    header, payload = decode_block(NS, value, expect_hash=HASHES[1])
    assert bytes(payload) == _blocks(2)[1].numpy().tobytes()
    tier.close()


def test_blocks_survive_close_and_reopen(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4)
    tier.write_n(tier.alloc_n(3), HASHES[:3], _blocks(3))
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 4)
    found = dict(tier.recover())
    assert set(found) == set(HASHES[:3]) and tier.num_free() == 1
    out = torch.zeros(3, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[h] for h in HASHES[:3]], HASHES[:3], out) == [True] * 3
    assert torch.equal(out, _blocks(3))
    tier.close()


def test_blocks_written_before_a_process_crash_are_found(tmp_path):
    child = textwrap.dedent(f"""
        import os, torch
        from kvstore.keys import Namespace, hash_blocks
        from kvstore.tiers.ssd import SsdTier
        ns = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
        hashes = hash_blocks(ns, list(range(40)))
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 256, (5, ns.block_bytes), dtype=torch.uint8, generator=g)
        tier = SsdTier(ns, {str(tmp_path)!r}, 8)
        tier.write_n(tier.alloc_n(5), hashes[:5], data)
        print("written", flush=True)
        os.kill(os.getpid(), 9)  # no close, no flush: a crash
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert proc.returncode == -9 and "written" in proc.stdout, proc.stderr
    tier = SsdTier(NS, str(tmp_path), 8)
    found = dict(tier.recover())
    assert set(found) == set(HASHES[:5])
    out = torch.zeros(5, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[h] for h in HASHES[:5]], HASHES[:5], out) == [True] * 5
    assert torch.equal(out, _blocks(5))
    tier.close()


def test_a_flipped_byte_on_disk_fails_verification(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))
    db = tier.raw_db()
    value = bytearray(db[bytes(HASHES[0])])
    value[HEADER_BYTES + 100] ^= 0x40
    db[bytes(HASHES[0])] = bytes(value)
    out = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(slots, HASHES[:2], out) == [False, True]
    tier.close()


def test_a_value_under_the_wrong_key_or_truncated_fails(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))
    db = tier.raw_db()
    db[bytes(HASHES[1])] = db[bytes(HASHES[0])]          # misplaced value
    out = torch.zeros(1, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(slots[1:], HASHES[1:2], out) == [False]
    db[bytes(HASHES[0])] = db[bytes(HASHES[0])][:-10]    # truncated value
    assert tier.read_n(slots[:1], HASHES[:1], out) == [False]
    tier.close()


def test_reopen_with_less_capacity_drops_the_excess_and_foreign_keys(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 6)
    tier.write_n(tier.alloc_n(5), HASHES[:5], _blocks(5))
    tier.raw_db()[b"not-a-hash"] = b"junk"
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 3)
    assert len(tier.recover()) == 3 and tier.num_free() == 0
    assert tier.num_dropped_at_open == 3
    tier.close()
    assert os.path.isdir(tmp_path)


def test_a_non_durable_tier_keeps_its_blocks_across_a_clean_close(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4, durable=False)
    tier.write_n(tier.alloc_n(2), HASHES[:2], _blocks(2))
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 4, durable=False)
    found = dict(tier.recover())
    out = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[h] for h in HASHES[:2]], HASHES[:2], out) == [True, True]
    assert torch.equal(out, _blocks(2))
    tier.close()
