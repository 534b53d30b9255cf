"""A daemon with host tiers only, and a client of it, never load torch: host bytes are numpy
(`kvstore.buffers`). Loading it cost every daemon start ~2 s and a few hundred MiB, and
brought thread pools that spin on the cores the engines need."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from kvstore import Client
from kvstore.events import TierKind
from kvstore.keys import hash_blocks

from .conftest import NS, ROOT, block_of


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def put_and_read_back(d, hs) -> dict:
    """Put the blocks and read them back exact, over TCP and the same-host path; the
    blocks each tier holds then."""
    data = np.stack([block_of(h, NS.block_bytes) for h in hs])
    for use_shm in (False, True):
        with Client(d.url, namespace=NS, use_shm=use_shm) as c:
            c.put_n(hs, data)
            out = np.zeros_like(data)
            tiers = c.get_n(hs, out)
            assert all(t is not None for t in tiers)
            assert np.array_equal(out, data)
            used = {t.kind: t.used_blocks for t in c.stats().tiers}
    return used


def test_a_daemon_that_served_every_tier_has_not_loaded_torch(make_daemon):
    d = make_daemon(dram_size="64KiB", ssd_size="4MiB")  # 16 DRAM slots: the rest on SSD
    put_and_read_back(d, hash_blocks(NS, list(range(40 * NS.block_tokens))))
    maps = _maps(d.pid)
    assert "libc" in maps  # (the check below can see a shared library)
    assert "libtorch" not in maps, "the daemon loaded torch"


CLIENT = """
import sys
import numpy as np
from kvstore import Client
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks
ns = Namespace("test-model", num_layers=1, num_kv_heads=1, head_dim=64)
hs = hash_blocks(ns, list(range(4 * ns.block_tokens)))
data = np.arange(4 * ns.block_bytes, dtype=np.uint64).astype(np.uint8).reshape(4, -1)
with Client(sys.argv[1], namespace=ns, use_shm=sys.argv[2] == "shm") as c:
    c.put_n(hs, data)
    out = np.zeros_like(data)
    assert c.get_n(hs, out) == c.get_n(hs, bytearray(out.nbytes)) and np.array_equal(out, data)
    assert c.match_prefix(hs).num_blocks == 4
print("torch" in sys.modules)
"""


def test_a_client_of_numpy_buffers_does_not_load_torch(make_daemon):
    d = make_daemon()
    for how in ("shm", "tcp"):
        out = subprocess.run([sys.executable, "-c", CLIENT, d.url, how], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "False", f"a {how} client loaded torch"


def test_a_gpu_tier_loads_torch_and_moves_blocks_through_every_tier(make_daemon):
    """The GPU tier is a torch arena (a CPU tensor here): the one tier that loads torch,
    its blocks demoted to the numpy DRAM arena and the SSD slabs and read back exact."""
    d = make_daemon("--gpu-size", "64KiB", dram_size="64KiB", ssd_size="4MiB")
    used = put_and_read_back(d, hash_blocks(NS, list(range(50 * NS.block_tokens,
                                                           90 * NS.block_tokens))))
    assert all(used[k] for k in (TierKind.GPU, TierKind.DRAM, TierKind.SSD)), used
    assert "libtorch" in _maps(d.pid)
