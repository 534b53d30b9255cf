"""A worker's stream queue keeps the first snapshot (it carries the hit stats) and only the
newest of those after it: each is cumulative, and a stream whose reader stalled had queued
one per step, each as long as the output so far (580 MB in 30 s for a 12k-token request)."""
from __future__ import annotations

import asyncio

from engine_adapter.serving.protocol import TokenEvent
from engine_adapter.serving.worker import Snapshots


def event(n: int, finished: bool = False, stats: int = 0) -> TokenEvent:
    return TokenEvent(tuple(range(n)), "x" * n, finished, None, num_model_tokens=stats)


def test_a_stalled_reader_finds_the_first_snapshot_and_the_newest_only():
    async def run():
        q = Snapshots()
        q.put_nowait(event(1, stats=7))
        for n in range(2, 10_000):
            q.put_nowait(event(n))
        assert q.qsize() == 2
        first, newest = q.get_nowait(), q.get_nowait()
        assert first.num_model_tokens == 7 and len(first.token_ids) == 1
        assert len(newest.token_ids) == 9_999
        q.put_nowait(event(10_000))
        q.put_nowait(event(10_001, finished=True))  # (replaces the one not read yet)
        err = RuntimeError("engine failed")
        q.put_nowait(err)
        q.put_nowait(event(10_002))  # nothing passes an exception
        got = [q.get_nowait() for _ in range(q.qsize())]
        assert [type(g) for g in got] == [TokenEvent, RuntimeError, TokenEvent]
        assert got[0].finished and got[1] is err
    asyncio.run(run())
