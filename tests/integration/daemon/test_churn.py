"""Every way in and out of one daemon at once, while its tiers churn: a hit is byte-exact.

A daemon with room for a few dozen blocks in DRAM and a few more on SSD, and one worker per
path a client can take: TCP (every block inline), the same host (direct reads from the
arena, leased slots, staged and direct puts), a transfer agent (leases read one-sided,
through staging or straight into the caller's rows), and the asyncio client over TCP and
over shared memory. Each puts fresh chains and reads back ones it put a while ago, with
get_n and get_prefix_n, so every read races puts that evict, demote to SSD, promote and
reuse the slots it reads. Blocks carry content derived from their hash (the oracle): a
miss is allowed (evicted), a hit with any other byte is not."""
from __future__ import annotations

import asyncio
import collections
import threading

import numpy as np
import pytest

from kvstore.client import AsyncClient, Client
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks

from .conftest import block_of

# 64 KiB blocks: an agent get of 8 or more goes straight into the caller's rows (512 KiB)
NS = Namespace("churn-model", num_layers=1, num_kv_heads=2, head_dim=64, block_tokens=128)
BB = NS.block_bytes
ROUNDS = 16
RECENT = 6  # chains a worker reads back from: several times what the tiers hold at once


def _chain(rng: np.random.Generator) -> list[bytes]:
    n = int(rng.integers(3, 13))
    return hash_blocks(NS, rng.integers(0, 1 << 30, n * NS.block_tokens))


def _blocks(hashes) -> np.ndarray:
    return np.stack([block_of(h, BB) for h in hashes])


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.bad: list[str] = []

    def check(self, who: str, hashes, dst: np.ndarray, tiers) -> None:
        with self.lock:
            for h, row, t in zip(hashes, dst, tiers):
                self.counts[who, t] += 1
                if t is not None and not np.array_equal(row, block_of(h, BB)):
                    self.bad.append(f"{who}: block {h.hex()} from {t.name} is not its bytes")


def _round(rng, recent: list, tally: Tally, who: str):
    """The reads of one round: (hashes, a zeroed destination) for get_n and for
    get_prefix_n, each of a chain put a while ago."""
    picks = [recent[int(rng.integers(len(recent)))] for _ in range(2)]
    return [(p, np.zeros((len(p), BB), np.uint8)) for p in picks]


def _sync_worker(client: Client, seed: int, tally: Tally, who: str) -> None:
    rng = np.random.default_rng(seed)
    recent: list[list[bytes]] = []
    with client:
        for _ in range(ROUNDS):
            chain = _chain(rng)
            client.put_n(chain, _blocks(chain))
            recent = (recent + [chain])[-RECENT:]
            (a, da), (b, db) = _round(rng, recent, tally, who)
            tally.check(who, a, da, client.get_n(a, da))
            m = client.get_prefix_n(b, db)
            tally.check(who, b[:m.num_blocks], db, m.tiers)


def _async_worker(url: str, seed: int, tally: Tally, who: str, **opts) -> None:
    async def run() -> None:
        rng = np.random.default_rng(seed)
        recent: list[list[bytes]] = []
        async with AsyncClient(url, namespace=NS, **opts) as client:
            for _ in range(ROUNDS):
                chain = _chain(rng)
                await client.put_n(chain, _blocks(chain))
                recent = (recent + [chain])[-RECENT:]
                (a, da), (b, db) = _round(rng, recent, tally, who)
                tally.check(who, a, da, await client.get_n(a, da))
                m = await client.get_prefix_n(b, db)
                tally.check(who, b[:m.num_blocks], db, m.tiers)
    asyncio.run(run())


@pytest.mark.timeout(180)
def test_every_path_at_once_against_churning_tiers_reads_only_exact_blocks(make_daemon):
    d = make_daemon("--dram-size", f"{32 * BB}", "--ssd-size", f"{96 * BB}")
    tally, errors = Tally(), []
    url = d.url
    workers = {
        "tcp": lambda s: _sync_worker(Client(url, namespace=NS, use_shm=False), s, tally, "tcp"),
        "shm": lambda s: _sync_worker(Client(url, namespace=NS), s, tally, "shm"),
        "agent": lambda s: _sync_worker(
            Client(url, namespace=NS, use_shm=False, use_agent=True, inline_put_bytes=0,
                   inline_get_bytes=0), s, tally, "agent"),
        "async tcp": lambda s: _async_worker(url, s, tally, "async tcp", use_shm=False),
        "async shm": lambda s: _async_worker(url, s, tally, "async shm"),
    }

    def guarded(fn, seed):
        try:
            fn(seed)
        except BaseException as e:  # noqa: BLE001 - reported below, with the worker's name
            errors.append(repr(e))
    threads = [threading.Thread(target=guarded, args=(fn, 10 + i))
               for i, fn in enumerate(list(workers.values()) * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert errors == []
    assert tally.bad == []
    counts = tally.counts
    for who in workers:  # every path read from both tiers, and missed what churned away
        assert all(counts[who, t] > 0 for t in (TierKind.DRAM, TierKind.SSD, None)), counts
