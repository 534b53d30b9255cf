"""The control plane's listener: at most `limit` HTTP connections open at once, and each
one's first request head whole within `deadline_s` of its connect.

aiohttp's server has neither: half-sent requests held their connections for as long as
their senders liked, in the descriptor table the data plane shares, and a few hundred of
them (a slow-loris client, no token needed) made every new namespace fail with "Too many
open files" while /healthz said 200. A connection past the cap is closed at once; one
whose request head is not in by the deadline is closed then, and an idle kept-alive one
after KEEPALIVE_S. A later request's head on a kept-alive connection has KEEPALIVE_S from
the last response: aiohttp (3.14) closes a connection whose keep-alive timer fires while no
whole request has come, and bytes of a partial head do not restart that timer (measured: a
head sent a byte a second was cut off 15.0 s after the response before it). Bodies are read
after the token check, each within a deadline of its own: `cluster.BODY_GRACE_S`.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from kvstore.daemon.dataplane import listen as bind

MAX_HTTP_CONNECTIONS = 128
HEADER_DEADLINE_S = 10.0
KEEPALIVE_S = 15.0  # an idle kept-alive connection is closed after this (aiohttp's own timer)


class Gate:
    def __init__(self, limit: int = MAX_HTTP_CONNECTIONS,
                 deadline_s: float = HEADER_DEADLINE_S) -> None:
        self.limit, self.deadline_s = limit, deadline_s
        self.active = 0
        self.refused = 0  # connections closed at once: the cap was reached
        self.expired = 0  # connections closed at the deadline: no request head by then


class _Guarded(asyncio.Protocol):
    """One HTTP connection: aiohttp's own handler behind the cap and the deadline."""

    def __init__(self, inner: asyncio.Protocol, gate: Gate) -> None:
        self.inner, self.gate = inner, gate
        self.admitted = False
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""  # the last bytes seen, for a head end split across two reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self.gate
        if gate.active >= gate.limit:
            gate.refused += 1
            transport.abort()  # (connection_lost follows: nothing to undo)
            return
        gate.active += 1
        self.admitted = True
        self.timer = asyncio.get_running_loop().call_later(gate.deadline_s, self._expire,
                                                           transport)
        self.inner.connection_made(transport)

    def _expire(self, transport: asyncio.BaseTransport) -> None:
        self.timer = None
        self.gate.expired += 1
        transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.timer is not None:
            seen = self.tail + data
            if b"\r\n\r\n" in seen:  # the first request's head is whole
                self.timer.cancel()
                self.timer = None
            else:
                self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.admitted:
            self.admitted = False
            self.gate.active -= 1
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


async def listen(factory: Callable[[], asyncio.Protocol], host: str, port: int,
                 gate: Gate) -> asyncio.AbstractServer:
    """Serve `factory`'s protocol (aiohttp's `AppRunner.server`) on host:port, guarded."""
    sock = bind(host, port)
    loop = asyncio.get_running_loop()
    try:
        return await loop.create_server(lambda: _Guarded(factory(), gate), sock=sock)
    except BaseException:
        sock.close()
        raise
