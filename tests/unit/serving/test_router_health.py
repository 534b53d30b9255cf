"""The router's health checks against a real aiohttp worker stand-in on loopback: a busy
worker stays in service, a silent one is taken out (its streams end) and comes back; the
engine loop survives a cancelled call."""
from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from engine_adapter.serving.engine_loop import EngineLoop
from engine_adapter.serving.protocol import Role, TokenEvent, frame
from engine_adapter.serving.router import Router, WorkerDiedError, WorkerHandle


async def _worker(silent: asyncio.Event, steps: int = 6, step_s: float = 0.3):
    """A stand-in worker: /info answers unless `silent`; /generate streams `steps` events
    `step_s` apart, stalling while `silent`."""
    async def info(request):
        while silent.is_set():
            await asyncio.sleep(0.05)
        return web.Response(body=b"ok")

    async def generate(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(steps):
            while silent.is_set():
                await asyncio.sleep(0.05)
            await resp.write(frame(TokenEvent(tuple(range(i + 1)), "x", i == steps - 1, None)))
            await asyncio.sleep(step_s)
        return resp
    app = web.Application()
    app.router.add_get("/info", info)
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def _stream(r: Router, w: WorkerHandle) -> str:
    try:
        async for _ in r.stream(w, "/generate", b""):
            pass
        return "ok"
    except WorkerDiedError as e:
        return str(e)


def test_a_busy_worker_stays_in_service():
    """120 streams in flight: the health checks had queued behind them for a connection
    (aiohttp's default cap of 100 per session), timed out, and the worker was taken out
    of service with every stream failed."""
    async def run():
        silent = asyncio.Event()
        runner, port = await _worker(silent)
        w = WorkerHandle("w", Role.COLOCATED, f"http://127.0.0.1:{port}")
        r = Router([w], worker_timeout_s=1.0)
        r.open_sessions()
        watch = asyncio.create_task(r.watch(0.05))
        try:
            got = await asyncio.gather(*(_stream(r, w) for _ in range(120)))
            return got, w.responsive
        finally:
            watch.cancel()
            await r.close()
            await runner.cleanup()
    got, responsive = asyncio.run(run())
    assert got == ["ok"] * 120 and responsive


def test_a_silent_worker_is_taken_out_and_comes_back():
    async def run():
        silent = asyncio.Event()
        runner, port = await _worker(silent, steps=40, step_s=0.05)
        w = WorkerHandle("w", Role.COLOCATED, f"http://127.0.0.1:{port}")
        r = Router([w], worker_timeout_s=1.0)
        r.open_sessions()
        watch = asyncio.create_task(r.watch(0.05))
        try:
            stream = asyncio.ensure_future(_stream(r, w))
            await asyncio.sleep(0.3)
            silent.set()
            said = await asyncio.wait_for(stream, 10)
            out = (said, w.responsive, r.live(Role.COLOCATED))
            silent.clear()
            for _ in range(100):
                if w.responsive:
                    break
                await asyncio.sleep(0.05)
            return out, w.responsive, await _stream(r, w)
        finally:
            watch.cancel()
            await r.close()
            await runner.cleanup()
    (said, responsive, live), back, again = asyncio.run(run())
    assert "answered no health check" in said and not responsive and live == []
    assert back and again == "ok"


def test_a_cancelled_call_leaves_the_engine_loop_running():
    """A handler awaiting EngineLoop.call cancelled before the engine thread ran it: setting
    its result raised on that thread and ended it; every request after hung."""
    class Idle:
        has_unfinished = False

        def close(self):
            pass
    loop, gate = EngineLoop(Idle()), threading.Event()

    async def run():
        slow = asyncio.ensure_future(asyncio.wrap_future(loop.call(lambda e: gate.wait(5))))
        doomed = asyncio.ensure_future(asyncio.wrap_future(loop.call(lambda e: "never")))
        await asyncio.sleep(0.05)
        doomed.cancel()
        gate.set()
        await slow
    asyncio.run(run())
    try:
        assert loop.call(lambda e: "later").result(timeout=5) == "later"
    finally:
        loop.close()
