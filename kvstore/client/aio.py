"""`AsyncClient`: the SDK's asyncio surface, the same methods as `Client` as coroutines.

Each call runs the blocking client's call on this client's own thread pool: the data
plane's bulk bytes move with blocking recv_into / sendmsg (which release the GIL and reach
the raw socket figure), so the event loop only waits on a future and is never blocked. The
exception is a small same-host read whose blocks the daemon's slot directory shows in DRAM:
it is copied right on the loop (no request, a few microseconds per block), since a hop to
the pool would cost more than the copy.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kvstore.buffers import byte_rows
from kvstore.client.sync import INLINE_PUT_BYTES, STAGED_PUT_BYTES, Client
from kvstore.events import TierKind
from kvstore.keys import Namespace
from kvstore.stats import StoreStats
from kvstore.store import MatchResult, PutStatus
from transfer import BackendKind


INLINE_READ_BYTES = 4 << 20  # direct reads up to this size run on the event loop


class AsyncClient:
    def __init__(self, url: str, token: str = "", namespace: Namespace | None = None, *,
                 timeout_s: float = 30.0, connect_timeout_s: float = 5.0, pool_size: int = 8,
                 use_shm: bool = True, inline_put_bytes: int = INLINE_PUT_BYTES,
                 staged_put_bytes: int = STAGED_PUT_BYTES, use_agent: bool = False,
                 agent_backends=(BackendKind.TCP,)) -> None:
        """Connects lazily: the first call (or `await connect()`) opens the connection."""
        self._args = (url, token, namespace)
        self._kw = dict(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                        pool_size=pool_size, use_shm=use_shm, inline_put_bytes=inline_put_bytes,
                        staged_put_bytes=staged_put_bytes, use_agent=use_agent,
                        agent_backends=agent_backends)
        self._pool = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="kvtier-client")
        self._client: Client | None = None
        self._connecting: asyncio.Lock | None = None

    async def connect(self) -> "AsyncClient":
        if self._client is None:
            self._connecting = self._connecting or asyncio.Lock()
            async with self._connecting:
                if self._client is None:
                    self._client = await self._in_pool(
                        functools.partial(Client, *self._args, **self._kw))
        return self

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _call(self, name: str, *args):
        await self.connect()
        return await self._in_pool(getattr(self._client, name), *args)

    async def put_n(self, hashes: Sequence[bytes], srcs) -> list[PutStatus]:
        return await self._call("put_n", hashes, srcs)

    async def put(self, key: bytes, value) -> PutStatus:
        return await self._call("put", key, value)

    async def get_n(self, hashes: Sequence[bytes], dsts) -> list[TierKind | None]:
        await self.connect()
        c = self._client
        arena = c._arena
        if (arena is None or arena.directory is None or not len(hashes)
                or len(hashes) * c.block_bytes > INLINE_READ_BYTES
                or not arena.directory.writer_alive()):
            return await self._in_pool(c.get_n, hashes, dsts)
        rows = byte_rows(dsts, len(hashes), c.block_bytes, writable=True)
        tiers, missed = c._direct_reads(arena, hashes, rows)
        batch = c._due_touches()
        if batch:
            await self._in_pool(c._send_touches, batch)
        if missed:
            found = await self._in_pool(c.get_n, [hashes[i] for i in missed],
                                        [rows[i] for i in missed])
            for i, t in zip(missed, found):
                tiers[i] = t
        return tiers


    async def get_prefix_n(self, hashes: Sequence[bytes], dsts) -> MatchResult:
        return await self._call("get_prefix_n", hashes, dsts)

    async def get_into(self, key: bytes, buffer) -> TierKind | None:
        return (await self.get_n([key], [buffer]))[0]

    async def get(self, key: bytes) -> bytes | None:
        await self.connect()
        out = bytearray(self._client.block_bytes)
        return bytes(out) if (await self.get_n([key], [out]))[0] is not None else None

    async def contains_n(self, hashes: Sequence[bytes]) -> list[bool]:
        return await self._call("contains_n", hashes)

    async def match_prefix(self, hashes: Sequence[bytes]) -> MatchResult:
        return await self._call("match_prefix", hashes)

    async def remove_n(self, hashes: Sequence[bytes]) -> int:
        return await self._call("remove_n", hashes)

    async def remove(self, key: bytes) -> bool:
        return await self._call("remove", key)

    async def pin_n(self, hashes: Sequence[bytes], ttl_s: float | None = None) -> list[bool]:
        return await self._call("pin_n", hashes, ttl_s)

    async def unpin_n(self, hashes: Sequence[bytes]) -> None:
        return await self._call("unpin_n", hashes)

    async def stats(self) -> StoreStats:
        return await self._call("stats")

    @property
    def uses_shm(self) -> bool:
        return self._client is not None and self._client.uses_shm

    @property
    def transport(self) -> str:
        return self._client.transport if self._client is not None else "tcp"

    async def close(self) -> None:
        if self._client is not None:
            await self._in_pool(self._client.close)
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()
