"""Big TCP batches of big blocks split over several connections at once (`Client.stripes`):
the same results, byte for byte and block for block, as one stream, and the split seen by
the daemon (its per-op request counts), not assumed."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvstore import Client
from kvstore.client.errors import ConnectError
from kvstore.client.sync import STRIPE_BLOCK_BYTES, STRIPE_BYTES
from kvstore.keys import Namespace, hash_blocks
from kvstore.store import PutStatus

from .conftest import block_of, op_count

NS = Namespace("stripes", num_layers=32, num_kv_heads=8, head_dim=64)  # 1 MiB blocks
BB = NS.block_bytes
N = 12  # 12 MiB: two stripes of 6 blocks


def chain(seed: int, n: int) -> list[bytes]:
    return hash_blocks(NS, np.arange(n * NS.block_tokens) + seed * 1_000_003)


def blocks(hs) -> torch.Tensor:
    return torch.from_numpy(np.stack([block_of(h, BB) for h in hs]))


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    from .conftest import Daemon
    d = Daemon(str(tmp_path_factory.mktemp("striped") / "data"), "--dram-size", "96MiB",
               "--ssd-size", "0")
    d.start()
    yield d
    d.close()


def test_the_namespace_is_big_enough_to_stripe():
    assert BB >= STRIPE_BLOCK_BYTES and N * BB >= 2 * STRIPE_BYTES


def test_a_striped_put_and_get_match_one_stream_and_take_one_request_per_stripe(big):
    hs = chain(1, N)
    src = blocks(hs)
    with Client(big.url, namespace=NS, use_shm=False) as c, \
            Client(big.url, namespace=NS, use_shm=False, stripes=1) as one:
        puts = op_count(big, "put")
        assert c.put_n(hs, src) == [PutStatus.STORED] * N
        assert op_count(big, "put", puts + 2) == puts + 2, "the put was not split in two"
        assert one.put_n(hs, src) == [PutStatus.EXISTS] * N
        assert op_count(big, "put", puts + 3) == puts + 3

        gets = op_count(big, "get")
        dst = torch.zeros_like(src)
        tiers = c.get_n(hs, dst)
        assert op_count(big, "get", gets + 2) == gets + 2, "the get was not split in two"
        assert torch.equal(dst, src)
        assert tiers == one.get_n(hs, torch.zeros_like(src))
        arrays = [np.zeros(BB, np.uint8) for _ in hs]  # one buffer per block
        assert None not in c.get_n(hs, arrays)
        assert all(np.array_equal(a, b) for a, b in zip(arrays, src.numpy()))


def test_misses_in_every_stripe_are_reported_in_place_and_leave_their_rows_alone(big):
    hs = chain(2, N)
    stored = [i for i in range(N) if i not in (0, 4, 7, 11)]  # misses in both halves
    with Client(big.url, namespace=NS, use_shm=False) as c:
        c.put_n([hs[i] for i in stored], blocks([hs[i] for i in stored]))
        dst = np.full((N, BB), 5, np.uint8)
        tiers = c.get_n(hs, dst)
        assert [t is not None for t in tiers] == [i in stored for i in range(N)]
        for i in range(N):
            want = block_of(hs[i], BB) if i in stored else np.full(BB, 5, np.uint8)
            assert np.array_equal(dst[i], want), f"block {i}"


def test_a_prefix_get_keeps_one_stream_and_writes_nothing_past_the_miss(big):
    hs = chain(3, N)
    with Client(big.url, namespace=NS, use_shm=False) as c:
        c.put_n(hs[:3] + hs[4:], blocks(hs[:3] + hs[4:]))  # a hole at 3
        gets = op_count(big, "get")
        dst = np.full((N, BB), 9, np.uint8)
        m = c.get_prefix_n(hs, dst)
        assert m.num_blocks == 3
        assert op_count(big, "get", gets + 1) == gets + 1
        assert all(np.array_equal(dst[i], block_of(hs[i], BB)) for i in range(3))
        assert (dst[3:] == 9).all(), "blocks past the prefix were written"


def test_small_batches_and_small_blocks_keep_one_stream(big, daemon):
    from .conftest import NS as SMALL
    hs = chain(4, 3)  # 3 MiB: under two stripes' worth
    with Client(big.url, namespace=NS, use_shm=False) as c:
        gets = op_count(big, "get")
        c.get_n(hs, np.zeros((3, BB), np.uint8))
        assert op_count(big, "get", gets + 1) == gets + 1
    small = hash_blocks(SMALL, np.arange(4096 * SMALL.block_tokens))  # 16 MiB of 4 KiB
    with Client(daemon.url, namespace=SMALL, use_shm=False) as c:
        puts = op_count(daemon, "put")
        c.put_n(small, np.zeros((len(small), SMALL.block_bytes), np.uint8))
        assert op_count(daemon, "put", puts + 1) == puts + 1


def test_a_striped_get_from_a_dead_daemon_raises_at_once(make_daemon):
    d = make_daemon("--dram-size", "32MiB", "--ssd-size", "0")
    hs = chain(5, N)
    c = Client(d.url, namespace=NS, use_shm=False, timeout_s=30, connect_timeout_s=2)
    try:
        c.put_n(hs, blocks(hs))
        d.close()
        t0 = time.monotonic()
        with pytest.raises(ConnectError):
            c.get_n(hs, torch.zeros(N, BB, dtype=torch.uint8))
        assert time.monotonic() - t0 < 20, "a stripe waited out its timeout"
    finally:
        c.close()
