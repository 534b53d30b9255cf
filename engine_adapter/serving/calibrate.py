"""Measure this worker's prefill, decode and pool-load timings at start, for the router's
cost model (`kvstore.scheduler.cost_model.fit_*`): the conductor's TTFT estimates then use
what this machine does now, not figures from another one.

Runs on the engine before it serves (~500 computed tokens, 2-3 s on one quiet core): a
warm-up, prefills of 32-256 tokens from scratch, short prefills after cached prefixes of
0.5-2k tokens (the attention term), the decode steps of all of them (batch 1 and 2, 0.1-2k
KV tokens), and reads of 2 to 16 blocks from the pool. A long cached prefix costs nothing to
set up: its blocks are registered in the prefix cache with whatever bytes they hold, since
a step takes as long over any K/V. The prompts are random tokens of their own, so they
share no block with real traffic (the made-up prefixes never reach the pool).
"""
from __future__ import annotations

import time
import zlib
from typing import NamedTuple

import numpy as np

from engine_adapter.sampling import SamplingParams
from kvstore.keys import hash_blocks
from kvstore.scheduler.cost_model import DecodeSample, PrefillSample, TransferSample

SEED = 0x6B76746965  # calibration prompts never collide with workload tokens
TOKEN_RANGE = (1000, 30000)


class Calibration(NamedTuple):
    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]
    load: tuple[TransferSample, ...]     # empty without a store


def calibrate(engine, worker_name: str) -> Calibration:
    """Each worker draws its own prompts: one sharing another's calibration blocks through
    the pool would measure a load, not the prefill it meant to."""
    rng = np.random.default_rng([SEED, zlib.crc32(worker_name.encode())])
    nb, bt = engine.config.num_blocks, engine.config.block_tokens
    cap = nb * bt // 2   # a tiny cache still fits every prompt with its 3 tokens
    ids = lambda n: rng.integers(*TOKEN_RANGE, min(n, cap)).tolist()  # noqa: E731
    _time_requests(engine, [ids(16)])  # warm-up: first-call allocations, not a sample
    long = ids(256)
    room = nb - 16   # blocks a made-up prefix may take, leaving room for the new tokens
    runs = [lambda: [long], lambda: [ids(96)], lambda: [ids(32)]]
    if room >= 8:
        runs += [lambda: [_cached_prefix(engine, rng, min(64, room)) + ids(64)],
                 lambda: [_cached_prefix(engine, rng, min(128, room)) + ids(32)],
                 lambda: [_cached_prefix(engine, rng, min(32, room // 2)) + ids(16)
                          for _ in range(2)]]
    prefill, decode = [], []
    for prompts in runs:  # each made-up prefix right before its run, or the next one's
        p, d = _time_requests(engine, prompts())  # allocation would take its blocks
        prefill += p
        decode += d
    load = _time_loads(engine, long) if engine.connector is not None else ()
    return Calibration(tuple(prefill), tuple(decode), tuple(load))


def _cached_prefix(engine, rng, num_blocks: int) -> list[int]:
    """Tokens of `num_blocks` blocks now in the engine's prefix cache (unreferenced, at the
    tail of the free queue: the next allocations take other blocks first)."""
    bt = engine.config.block_tokens
    tokens = rng.integers(*TOKEN_RANGE, num_blocks * bt).tolist()
    blocks = engine.pool.allocate_n(num_blocks)
    engine.pool.cache_n(blocks, hash_blocks(engine.ns, tokens))
    engine.pool.free_n(blocks)
    return tokens


def _time_requests(engine, prompts: list[list[int]]) -> tuple[list, list]:
    """Run prompts together, 3 tokens each. The steps until every prompt has its first
    token are the prefill (a sample when there is one prompt); each later step is a decode
    step of the unfinished requests over the tokens they hold."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    prefill_s, decode = 0.0, []
    while any(not r.finished for r in reqs):
        live = [r for r in reqs if not r.finished]
        decoding = all(r.output_token_ids for r in reqs)
        kv_tokens = sum(r.num_tokens for r in live)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if decoding:
            decode.append(DecodeSample(len(live), kv_tokens, dt))
        else:
            prefill_s += dt
    if len(reqs) != 1:
        return [], decode
    r = reqs[0]
    cached = r.num_local_hit_tokens + r.num_loaded_tokens
    return [PrefillSample(r.num_prompt_tokens - cached, cached, prefill_s)], decode


def _time_loads(engine, prompt: list[int]) -> list[TransferSample]:
    """Reads of 2 to 24 blocks from the pool (best of 3 each). The blocks are put right
    before (a small pool may have evicted the prefill's own since); a read that misses
    (another worker's calibration evicted them meanwhile) is no sample."""
    bt, cache = engine.config.block_tokens, engine.runner.kv_cache
    hashes = hash_blocks(engine.ns, prompt[:len(prompt) // bt * bt])
    if not hashes:
        return []  # (a prompt under one block: nothing to time)
    staged = cache.new_zeros((len(hashes), *cache.shape[1:]))
    out = []
    for n in (2, 8, len(hashes)):
        engine.connector.store.put_n(hashes[:n], staged[:n])
        times = [_timed_get(engine.connector.store, hashes[:n], staged[:n]) for _ in range(3)]
        if None not in times:
            out.append(TransferSample(n * staged[0].numel() * staged.element_size(), min(times)))
    return out


def _timed_get(store, hashes, dst) -> float | None:
    t0 = time.perf_counter()
    found = store.get_n(hashes, list(dst))
    return None if None in found else time.perf_counter() - t0
