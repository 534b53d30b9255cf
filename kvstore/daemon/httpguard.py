"""The control plane's listener: at most `limit` HTTP connections open at once, and each
one's first request head whole within `deadline_s` of its connect.

aiohttp's server has neither: half-sent requests held their connections for as long as
their senders liked, in the descriptor table the data plane shares, and a few hundred of
them (a slow-loris client, no token needed) made every new namespace fail with "Too many
open files" while /healthz said 200. A connection whose request head is not in by the
deadline is closed then, and an idle kept-alive one after KEEPALIVE_S.

At the cap, a new connection takes the place of an idle one (no request being handled:
between requests, or before its first head is whole): a stranger's (no request on it
carried a token the daemon knows) that was served already, the longest idle first; then
one not served yet, the oldest first; then a trusted one, the longest idle first. Only when every connection is handling
a request is the new one closed at once. Refusing every newcomer instead let a stranger
lock the control port: 128 kept-alive connections, each sending a token-free /healthz
every 10 s (so the keep-alive timer never fired), kept the admin's /stats out 40 of 40
times, and with it /metrics scrapes and a pool's /cluster calls. `Gate.middleware` tells
the gate which connections are handling a request and which have shown a good token. A later request's head on a kept-alive connection has KEEPALIVE_S from
the last response: aiohttp (3.14) closes a connection whose keep-alive timer fires while no
whole request has come, and bytes of a partial head do not restart that timer (measured: a
head sent a byte a second was cut off 15.0 s after the response before it). Bodies are read
after the token check, each within a deadline of its own: `cluster.BODY_GRACE_S`.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Awaitable, Callable

from aiohttp import web

from kvstore.daemon.dataplane import listen as bind

MAX_HTTP_CONNECTIONS = 128
HEADER_DEADLINE_S = 10.0
KEEPALIVE_S = 15.0  # an idle kept-alive connection is closed after this (aiohttp's own timer)


class Gate:
    """`trusted(request)`: whether the request carries a token the daemon knows (its
    connection is pushed out after those of strangers)."""

    def __init__(self, limit: int = MAX_HTTP_CONNECTIONS,
                 deadline_s: float = HEADER_DEADLINE_S,
                 trusted: Callable[[web.Request], bool] = lambda request: False) -> None:
        self.limit, self.deadline_s = limit, deadline_s
        self.trusted = trusted
        self.open: dict[asyncio.BaseTransport, _Guarded] = {}  # admitted, by transport
        self.refused = 0  # connections closed at once: the cap was reached, none idle
        self.expired = 0  # connections closed at the deadline: no request head by then
        self.pushed_out = 0  # idle connections closed to make room for a new one

    @property
    def active(self) -> int:
        return len(self.open)

    def admit(self) -> bool:
        """Room for one more connection: there is, or an idle one is pushed out for it."""
        if len(self.open) < self.limit:
            return True
        victim, rank = None, None
        for conn in self.open.values():  # (128 at most, and only at the cap)
            if conn.busy:
                continue
            # strangers' kept-alive connections first (the longest idle first), then ones
            # yet to be served (the oldest first: a stranger cannot make its own look
            # younger than a client's just-opened one by sending bytes), then trusted ones
            r = ((2, conn.last) if conn.trusted else (0, conn.last) if conn.served
                 else (1, conn.opened))
            if rank is None or r < rank:
                victim, rank = conn, r
        if victim is None:
            return False
        self.pushed_out += 1
        victim.close()
        return True

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        """Marks the request's connection busy while its handler runs (not to be pushed
        out), and trusted once a request on it carried a known token."""
        conn = self.open.get(request.transport)
        if conn is None:
            return await handler(request)
        conn.busy += 1
        conn.served = True
        try:
            if not conn.trusted and self.trusted(request):
                conn.trusted = True
            return await handler(request)
        finally:
            conn.busy -= 1
            conn.last = asyncio.get_running_loop().time()


class _Guarded(asyncio.Protocol):
    """One HTTP connection: aiohttp's own handler behind the cap and the deadline."""

    def __init__(self, inner: asyncio.Protocol, gate: Gate) -> None:
        self.inner, self.gate = inner, gate
        self.admitted = False
        self.transport: asyncio.BaseTransport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""  # the last bytes seen, for a head end split across two reads
        self.busy = 0  # requests being handled (Gate.middleware)
        self.trusted = False  # a request on it carried a known token
        self.served = False  # a request on it reached its handler
        self.opened = self.last = 0.0  # loop time of its connect; of its last bytes in or
        # request handled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self.gate
        if not gate.admit():
            gate.refused += 1
            transport.abort()  # (connection_lost follows: nothing to undo)
            return
        loop = asyncio.get_running_loop()
        self.transport, self.admitted = transport, True
        self.opened = self.last = loop.time()
        gate.open[transport] = self
        self.timer = loop.call_later(gate.deadline_s, self._expire)
        self.inner.connection_made(transport)

    def _expire(self) -> None:
        self.timer = None
        self.gate.expired += 1
        self.close()

    def close(self) -> None:
        """Abort the connection, its slot free at once (connection_lost comes later)."""
        self._leave()
        if self.transport is not None:
            self.transport.abort()

    def _leave(self) -> None:
        if self.gate.open.get(self.transport) is self:
            del self.gate.open[self.transport]

    def data_received(self, data: bytes) -> None:
        self.last = asyncio.get_running_loop().time()
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
            self._leave()
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


async def listen(factory: Callable[[], asyncio.Protocol], host: str, port: int,
                 gate: Gate) -> asyncio.AbstractServer:
    """Serve `factory`'s protocol (aiohttp's `AppRunner.server`) on host:port, guarded."""
    return await serve_on(factory, bind(host, port), gate)


async def serve_on(factory: Callable[[], asyncio.Protocol], sock: socket.socket,
                   gate: Gate) -> asyncio.AbstractServer:
    """Serve `factory`'s protocol on a bound socket (listening or not), guarded; the socket
    is closed if that fails."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.create_server(lambda: _Guarded(factory(), gate), sock=sock)
    except BaseException:
        sock.close()
        raise
