"""The front end reads a request's body within a deadline: a client that announced a body
and sent nothing held its connection (and a handler) for good. A real aiohttp server on
loopback, the front end's body reader in its handler, a raw socket as the client."""
from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from engine_adapter.serving import frontend


def test_a_body_that_never_comes_is_a_408_within_the_deadline(monkeypatch):
    monkeypatch.setattr(frontend, "BODY_DEADLINE_S", 0.5)

    async def handler(request: web.Request) -> web.Response:
        try:
            return web.json_response(await frontend._body(request))
        except TimeoutError:
            return web.Response(status=408)

    async def run() -> bytes:
        app = web.Application()
        app.router.add_post("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            loop = asyncio.get_running_loop()
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"a\"")
            reply = await loop.run_in_executor(None, s.recv, 4096)
            s.close()
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 8\r\n\r\n{\"a\": 1}")
            whole = await loop.run_in_executor(None, s.recv, 4096)
            s.close()
            return reply, whole
        finally:
            await runner.cleanup()
    late, whole = asyncio.run(run())
    assert late.startswith(b"HTTP/1.1 408")
    assert whole.startswith(b"HTTP/1.1 200") and whole.endswith(b'{"a": 1}')
