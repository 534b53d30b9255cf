"""The SDK against a real daemon: every op, both paths (shared memory and TCP), byte-exact."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kvstore import AsyncClient, Client
from kvstore.errors import KVStoreError
from kvstore.events import TierKind
from kvstore.keys import hash_blocks
from kvstore.store import PutStatus

from .conftest import NS, block_of

BB = NS.block_bytes


def chain(seed: int, n: int) -> list[bytes]:
    return hash_blocks(NS, np.arange(n * NS.block_tokens) + seed * 1_000_003)


PATHS = ["shm", "tcp", "agent", "staged"]


@pytest.fixture(params=PATHS)
def client(request, daemon):
    # shm and agent: every put takes the reserve / copy into slots / commit path; staged:
    # same-host puts copied into the connection's staging segment, one request each
    path = request.param
    c = Client(daemon.url, namespace=NS, use_shm=path in ("shm", "staged"), inline_put_bytes=0,
               inline_get_bytes=0,
               staged_put_bytes=0 if path == "shm" else 1 << 20, use_agent=path == "agent")
    assert c.transport == ("shm" if path == "staged" else path)  # same host: shm negotiated
    c.test_path = path
    yield c
    c.close()


def test_put_get_byte_exact_tensor_and_numpy(client):
    hs = chain(1 + PATHS.index(client.test_path), 12)
    src = torch.from_numpy(np.stack([block_of(h, BB) for h in hs]))
    assert client.put_n(hs, src) == [PutStatus.STORED] * 12
    assert client.put_n(hs, src) == [PutStatus.EXISTS] * 12  # content-addressed no-op
    dst = torch.zeros_like(src)
    assert all(t is not None for t in client.get_n(hs, dst))
    assert torch.equal(dst, src)
    arrays = [np.zeros(BB, np.uint8) for _ in hs]
    assert None not in client.get_n(hs, arrays)
    assert all((a == block_of(h, BB)).all() for a, h in zip(arrays, hs))
    assert client.get(hs[3]) == block_of(hs[3], BB).tobytes()


def test_misses_leave_destination_alone(client):
    hs = chain(10 + PATHS.index(client.test_path), 3)
    client.put(hs[1], block_of(hs[1], BB))
    dst = np.full((3, BB), 7, np.uint8)
    tiers = client.get_n(hs, dst)
    assert tiers[0] is None and tiers[2] is None and tiers[1] is not None
    assert (dst[0] == 7).all() and (dst[1] == block_of(hs[1], BB)).all()
    assert client.get(b"\x00" * 16) is None


@pytest.mark.parametrize("kind", ["tensor", "flat numpy", "row list"])
def test_hits_around_misses_land_in_their_own_rows(client, kind):
    """Hits come back inline (TCP) or leased (same host) in batch order, misses between
    them: each lands in its own row of any destination form, the misses' rows untouched."""
    hs = chain(20 + PATHS.index(client.test_path) + 10 * len(kind), 5)
    for i in (0, 2, 4):
        client.put(hs[i], block_of(hs[i], BB))
    dst = {"tensor": torch.full((5, BB), 7, dtype=torch.uint8),
           "flat numpy": np.full(5 * BB, 7, np.uint8),
           "row list": [bytearray(b"\x07" * BB) for _ in range(5)]}[kind]
    tiers = client.get_n(hs, dst)
    assert [t is not None for t in tiers] == [True, False, True, False, True]
    rows = [np.frombuffer(r, np.uint8) for r in dst] if kind == "row list" else \
        np.asarray(dst).reshape(5, BB)
    for i, h in enumerate(hs):
        assert (rows[i] == (block_of(h, BB) if i % 2 == 0 else 7)).all(), i


def test_metadata_ops_match_store_semantics(client):
    hs = chain(20 + PATHS.index(client.test_path), 8)
    client.put_n(hs[:5], [block_of(h, BB) for h in hs[:5]])
    assert client.contains_n(hs) == [True] * 5 + [False] * 3
    assert client.contains_n(hs[4:6]) == [True, False]
    m = client.match_prefix(hs)
    assert m.num_blocks == 5 and all(isinstance(t, TierKind) for t in m.tiers)
    assert client.remove(hs[2]) is True and client.remove(hs[2]) is False
    assert client.match_prefix(hs).num_blocks == 2
    assert client.pin_n(hs[:3]) == [True, True, False]
    client.unpin_n(hs[:2])
    for ttl in (float("inf"), float("nan"), -1.0):  # a clear error, the connection usable
        with pytest.raises(KVStoreError, match="ttl_s"):
            client.pin_n(hs[:1], ttl_s=ttl)
    assert client.pin_n(hs[:1], ttl_s=1.0) == [True]
    s = client.stats()
    assert s.block_bytes == BB and sum(t.used_blocks for t in s.tiers) >= 4


def test_wrong_buffer_size_is_refused_before_sending(client):
    from kvstore.errors import BlockSizeError
    with pytest.raises(BlockSizeError):
        client.put_n(chain(30, 2), np.zeros(BB, np.uint8))


def test_async_client_same_surface(daemon):
    async def main():
        async with AsyncClient(daemon.url, namespace=NS) as c:
            hs = chain(40, 6)
            src = np.stack([block_of(h, BB) for h in hs])
            assert await c.put_n(hs, src) == [PutStatus.STORED] * 6
            dst = np.zeros_like(src)
            results = await asyncio.gather(c.get_n(hs[:3], dst[:3]), c.get_n(hs[3:], dst[3:]))
            assert None not in results[0] + results[1] and (dst == src).all()
            assert (await c.match_prefix(hs)).num_blocks == 6
            assert await c.contains_n(hs[:1]) == [True]
            assert await c.get(hs[0]) == src[0].tobytes()
            assert await c.remove(hs[5])
            assert (await c.stats()).block_bytes == BB
    asyncio.run(main())


def test_a_get_into_part_of_a_tensor_of_any_dtype_writes_only_that_part(client):
    """Same host, a few blocks into one CPU tensor: copied by its address (with its
    storage offset), so a slice of a bigger tensor, or a float16 cache's rows, get the
    blocks' bytes and nothing around them is written."""
    hs = chain(130 + PATHS.index(client.test_path), 3)
    src = np.stack([block_of(h, BB) for h in hs])
    client.put_n(hs, src)
    big = torch.full((6, BB), 7, dtype=torch.uint8)
    assert None not in client.get_n(hs, big[2:5])
    assert np.array_equal(big[2:5].numpy(), src)
    assert (big[:2] == 7).all() and (big[5:] == 7).all()
    half = torch.zeros(3, 2, BB // 4, dtype=torch.float16)
    assert None not in client.get_n(hs, half)
    assert np.array_equal(half.view(torch.uint8).reshape(3, BB).numpy(), src)
    hole = torch.full((3, BB), 5, dtype=torch.uint8)  # a miss between two hits
    assert [t is not None for t in client.get_n([hs[0], b"\x01" * 16, hs[2]], hole)] == \
        [True, False, True]
    assert np.array_equal(hole[0].numpy(), src[0]) and (hole[1] == 5).all()
    m = client.get_prefix_n([hs[0], hs[1], b"\x01" * 16], hole)
    assert m.num_blocks == 2 and np.array_equal(hole[:2].numpy(), src[:2])
    with pytest.raises(ValueError, match="16 bytes"):
        client.get_n([b"short"], torch.zeros(1, BB, dtype=torch.uint8))


def test_get_prefix_n_reads_the_stored_prefix_in_one_visit(client):
    hs = chain(140 + PATHS.index(client.test_path), 10)
    client.put_n(hs[:4] + hs[5:], [block_of(h, BB) for h in hs[:4] + hs[5:]])  # a hole at 4
    dst = np.full((10, BB), 9, np.uint8)
    m = client.get_prefix_n(hs, dst)
    assert m.num_blocks == 4 and len(m.tiers) == 4
    assert all(np.array_equal(dst[i], block_of(hs[i], BB)) for i in range(4))
    assert (dst[4:] == 9).all(), "blocks past the prefix were written"
    assert client.get_prefix_n(chain(99, 3), np.zeros((3, BB), np.uint8)).num_blocks == 0


def test_a_same_host_ssd_hit_comes_through_its_promoted_dram_slot(make_daemon):
    """One store visit per hash, counted once; the SSD block reaches a same-host client
    through the DRAM slot it was promoted into, not inline over the socket."""
    import re
    import urllib.request
    d = make_daemon("--dram-size", "16KiB")  # 4 DRAM slots
    hs = chain(77, 12)
    with Client(d.url, namespace=NS, staged_put_bytes=0) as c:
        c.put_n(hs, np.stack([block_of(h, BB) for h in hs]))  # 8 demoted to SSD
        on_ssd = [h for h in hs if c.match_prefix([h]).tiers == (TierKind.SSD,)]
        assert len(on_ssd) >= 4
        want = on_ssd[:2]

        def out_bytes() -> float:
            text = urllib.request.urlopen(d.http + "/metrics", timeout=5).read().decode()
            return float(re.search(r'kvtier_net_bytes_total{direction="out"} (\S+)',
                                   text).group(1))
        hits, before = c.stats().hits, out_bytes()
        dst = np.zeros((2, BB), np.uint8)
        assert c.get_n(want, dst) == [TierKind.SSD] * 2
        assert all(np.array_equal(o, block_of(h, BB)) for o, h in zip(dst, want))
        assert out_bytes() == before, "the promoted blocks were sent inline"
        assert c.stats().hits == hits + 2, "a block was counted twice"
        assert [c.match_prefix([h]).tiers for h in want] == [(TierKind.DRAM,)] * 2


def test_a_tcp_get_streams_dram_slots_and_falls_back_for_a_batch_with_ssd_blocks(make_daemon):
    """A TCP client's GET of a DRAM-resident batch is sent from the held slots; a batch
    with one block on SSD takes the copying path: bytes exact, every hit counted once,
    nothing left held, and the DRAM blocks still evictable afterwards."""
    d = make_daemon("--dram-size", "16KiB")  # 4 DRAM slots
    hs = chain(88, 10)
    with Client(d.url, namespace=NS, use_shm=False) as c:
        c.put_n(hs, np.stack([block_of(h, BB) for h in hs]))  # 6 demoted to SSD
        tiers = [c.match_prefix([h]).tiers[0] if c.match_prefix([h]).num_blocks else None
                 for h in hs]
        in_dram = [h for h, t in zip(hs, tiers) if t is TierKind.DRAM]
        on_ssd = [h for h, t in zip(hs, tiers) if t is TierKind.SSD]
        assert in_dram and on_ssd
        stranger = chain(99, 1)[0]
        for batch in ([*in_dram, stranger], [on_ssd[0], *in_dram]):
            hits = c.stats().hits
            misses = c.stats().misses
            dst = np.zeros((len(batch), BB), np.uint8)
            got = c.get_n(batch, dst)
            assert [g is not None for g in got] == [h != stranger for h in batch]
            assert all(np.array_equal(o, block_of(h, BB)) for o, h, g in zip(dst, batch, got) if g)
            assert c.stats().hits == hits + sum(g is not None for g in got)
            assert c.stats().misses == misses + (stranger in batch)
        assert c.stats().open_leases == 0
        # nothing stays held: a fresh batch of puts can still evict the blocks just read
        more = chain(89, 8)
        assert all(s is not PutStatus.NO_SPACE for s in
                   c.put_n(more, np.stack([block_of(h, BB) for h in more])))


@pytest.mark.parametrize("bad", ["abcdefghijklmnop", 5, 3.0], ids=["str", "int", "float"])
def test_a_hash_that_is_not_bytes_is_refused_saying_so(client, bad):
    """A str hash raised "string argument without an encoding", an int "object of type 'int'
    has no len()" over TCP and, on the same-host path, became bytes(5): five zero bytes,
    refused as "not 5"."""
    rows = np.zeros((1, BB), np.uint8)
    for call in (lambda: client.put_n([bad], rows), lambda: client.get_n([bad], rows)):
        with pytest.raises(TypeError, match=f"16-byte bytes objects .*not {type(bad).__name__}"):
            call()
    h = hash_blocks(NS, np.arange(16) + 8080)
    assert client.put_n(h, [block_of(h[0], BB)]) in ([PutStatus.STORED], [PutStatus.EXISTS])


def test_numpy_subclasses_are_plain_host_buffers(daemon, tmp_path):
    """np.memmap rows (a subclass of np.ndarray) as sources and destinations over TCP:
    the inline paths tested for exactly np.ndarray and took them for tensors."""
    hs = hash_blocks(NS, list(range(1000 * NS.block_tokens, 1003 * NS.block_tokens)))
    src = np.memmap(tmp_path / "src", np.uint8, "w+", shape=(3, NS.block_bytes))
    src[:] = np.stack([block_of(h, NS.block_bytes) for h in hs])
    dst = np.memmap(tmp_path / "dst", np.uint8, "w+", shape=(3, NS.block_bytes))
    with Client(daemon.url, namespace=NS, use_shm=False) as c:
        assert c.put_n(hs, [src[0], src[1], src[2]]) == [PutStatus.STORED] * 3
        assert None not in c.get_n(hs, dst)
        assert np.array_equal(dst, src)
        rows = [np.memmap(tmp_path / f"r{i}", np.uint8, "w+", shape=(NS.block_bytes,))
                for i in range(3)]
        assert None not in c.get_n(hs, rows)
        assert all(np.array_equal(r, s) for r, s in zip(rows, src))
