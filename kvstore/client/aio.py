"""`AsyncClient`: the SDK on asyncio, the same ops as `Client` as coroutines.

Native: every request is a frame written and read on the event loop (`aconn`), with no
thread pool in between, so thousands of concurrent calls cost coroutines, not threads.
Bytes move as with `Client`: on the daemon's host through the namespace's shared arena
(direct reads with no request, puts through the put channel or the staging segment, leased
slots), elsewhere inline in the frames (received straight into the caller's buffers). The
transfer-agent path (`Client(use_agent=True)`) is blocking and stays with `Client`.

Copies into and out of shared memory run on the loop: a few microseconds per block, less
than a hop to a thread would cost, but a multi-megabyte batch holds the loop for as long as
its memcpy takes (~1 ms per 5 MB)."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import numpy as np

from kvstore import wire as w
from kvstore.buffers import (byte_rows, host_address, host_rows, read_rows, request_rows,
                              select_rows)
from kvstore.client.aconn import AsyncConnection
from kvstore.client.conn import LocalAddress, cut, parse_url
from kvstore.client.errors import ConnectError, RequestTimeout
from kvstore.client import forks
from kvstore.client.putpath import DirectPuts
from kvstore.client.replies import (MAX_STAGE_BYTES, SPIN_US, STAGED_PUT_BYTES, TouchLog,
                                    as_numpy, check_timeouts, copy_row, drop_late_copies,
                                    flags_of, get_layout,
                                    payload_views, row_view, match_of, put_statuses,
                                    raise_unless_retryable, reusable_after, stage, stats_of)
from kvstore.client.shm import SHARE_REFUSALS, VECTOR_READS, ArenaMap, open_arena
from kvstore.events import TierKind
from kvstore.keys import Namespace
from kvstore.putring import DIRECT_PUTS
from kvstore.stats import StoreStats
from kvstore.api import MatchResult, PutStatus, leading_hits
from transfer.sockio import Spin

# failures after which a call is retried once on a fresh connection (daemon restarted)


class AsyncClient:
    def __init__(self, url: str, token: str = "", namespace: Namespace | None = None, *,
                 timeout_s: float = 30.0, connect_timeout_s: float = 5.0, pool_size: int = 8,
                 use_shm: bool = True, staged_put_bytes: int = STAGED_PUT_BYTES,
                 direct_puts: bool = True, spin_us: float = SPIN_US) -> None:
        """Connects lazily: the first call (or `await connect()`, or `async with`) opens the
        first connection. `pool_size` idle connections are kept; concurrent calls open
        more as they need them.

        `spin_us`: while a call is this client's only one, its connection polls for the
        reply (header and payload) for up to this long before it waits on the loop (as
        `Client`'s does): it holds the event loop meanwhile, at most `spin_us` per wait,
        and the window halves after each long wait. 0: never."""
        if namespace is None:
            raise ValueError("AsyncClient needs namespace=Namespace(model, num_layers, "
                             "num_kv_heads, head_dim, ...): the model whose KV blocks it stores")
        check_timeouts(timeout_s, connect_timeout_s)
        self.addr, self.token, self.ns = parse_url(url), token, namespace
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.pool_size, self.use_shm = pool_size, use_shm
        self.staged_put_bytes = staged_put_bytes
        self.direct_puts = use_shm and direct_puts and DIRECT_PUTS
        self.block_bytes = namespace.block_bytes
        self._idle: list[AsyncConnection] = []
        self._spin = Spin(spin_us * 1e-6)  # shared by the calls, one at a time (_hand_out)
        self._busy: set[AsyncConnection] = set()  # connections handed out (`_conn`)
        self._arena: ArenaMap | None = None
        self._local: LocalAddress | None = None
        self._puts: DirectPuts | None = None
        self._puts_conn: AsyncConnection | None = None
        self._puts_lock: asyncio.Lock | None = None  # made on the loop, at first use
        self._touches = TouchLog()  # direct reads the daemon has not heard of yet
        self._touch_task: asyncio.Task | None = None  # the TOUCH in flight, if any
        self._connected = self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # where its connections live
        forks.track(self)

    async def _follow_loop(self) -> None:
        """Called on the loop each call runs on. Connections, the put channel's and the
        TOUCH in flight belong to the loop they were made on; on another loop (a second
        `asyncio.run`) they are let go and made again there (reused, they failed now and
        then with 'Event loop is closed'). Puts the channel published are committed first
        (the daemon's drainer takes them at their doorbell; waited for on this loop, within
        timeout_s, else RequestTimeout, as a FLUSH's): the new loop's calls see them.
        For calls on several loops at once, make one client per loop."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        first, self._loop = self._loop is None, loop
        if first:
            return
        idle, self._idle = self._idle, []
        puts, puts_conn = self._puts, self._puts_conn
        self._puts = self._puts_conn = None
        self._puts_lock, self._touch_task = None, None
        for conn in idle:
            conn.close()
        if puts is None:
            return
        try:
            deadline = time.monotonic() + self.timeout_s
            while puts.pending():
                if time.monotonic() > deadline:
                    raise RequestTimeout(f"the daemon did not commit this client's puts within "
                                         f"{self.timeout_s}s (a FLUSH would have waited as long)")
                await asyncio.sleep(0.0005)
        finally:
            puts.close(flush=False)
            puts_conn.close()

    def _after_fork(self) -> None:
        """In a child made by os.fork() (kvstore.client.forks): this process's copies of
        the parent's connections, put channel and arena mapping go, none of them used (the
        parent still is); the next call connects afresh."""
        idle, self._idle = self._idle + list(self._busy), []  # (busy: in a call of the
        # parent's at the fork; its descriptor here kept the connection open at the daemon)
        puts, puts_conn = self._puts, self._puts_conn
        arena, self._arena = self._arena, None
        self._puts = self._puts_conn = None
        self._puts_lock, self._touch_task, self._loop = None, None, None
        self._busy, self._touches = set(), TouchLog()
        for conn in idle:
            conn.close()  # (only this process's descriptor: the socket stays the parent's)
        if puts is not None:
            puts.forget()
            puts_conn.close()
        if arena is not None:
            arena.close()

    async def connect(self) -> AsyncClient:
        """Open (and check: address, token, namespace) a first connection now."""
        if not self._connected:
            async with self._conn():
                pass
            self._connected = True
        return self

    # ------------------------------------------------------------ connections

    async def _open(self, addr) -> AsyncConnection:
        return await AsyncConnection.open(addr, self.token, self.ns, self.timeout_s,
                                          self.connect_timeout_s)

    async def _new_conn(self) -> AsyncConnection:
        """Over the daemon's local socket once found (same host), else over TCP."""
        conn = None
        if self._local is not None:
            try:
                conn = await self._open(self._local)
            except ConnectError:
                self._local = None  # the daemon restarted (a new socket): find it again
        if conn is None:
            conn = await self._open(self.addr)
            if self.use_shm and conn.info.local_socket:
                conn = await self._go_local(conn)
        try:
            await self._check_arena(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    async def _go_local(self, tcp: AsyncConnection) -> AsyncConnection:
        local = LocalAddress(tcp.info.local_socket)
        try:
            conn = await self._open(local)
        except (ConnectError, w.RemoteError, OSError):
            return tcp  # another host (or network namespace): TCP it is
        if conn.info.instance != tcp.info.instance:
            conn.close()  # not the daemon we authenticated with over TCP
            return tcp
        tcp.close()
        self._local = local
        return conn

    async def _check_arena(self, conn: AsyncConnection) -> None:
        """Map the namespace's arena the first time, or again after the daemon replaced it."""
        info = conn.info
        if not conn.local or (self._arena is not None and self._arena.arena_id == info.arena_id):
            return
        arena = None
        if info.arena_id:
            try:
                reply, (arena_fd, dir_fd) = await conn.call_fds(w.Share(), 2)
            except w.RemoteError as e:  # (as map_arena: blocks go inline)
                if e.code not in SHARE_REFUSALS:
                    raise
                reply = None
            if reply is not None:
                arena = open_arena(reply, arena_fd, dir_fd, self.block_bytes)
        if self._closed:  # closed while this task connected: mapped again, the arena had let
            # every read after close() go on from it, never told the client is closed
            if arena is not None:
                arena.close()
            raise ConnectError("this AsyncClient is closed (by another task, during this call)")
        old, self._arena = self._arena, arena
        if old is not None:
            old.close()

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[AsyncConnection]:
        if self._closed:
            raise ConnectError("this AsyncClient is closed")
        await self._follow_loop()
        conn = self._idle.pop() if self._idle else await self._new_conn()
        self._hand_out(conn)
        try:
            yield conn
        except BaseException as e:
            if reusable_after(e):
                self._give_back(conn)
            else:
                conn.close()  # mid-frame (or cancelled): never reuse it
            raise
        else:
            self._give_back(conn)
        finally:
            self._take_back(conn)

    def _hand_out(self, conn: AsyncConnection) -> None:
        """A connection polls (`spin_us`) only while its call is this client's only one:
        polling holds the loop, which the others' replies would wait for."""
        self._busy.add(conn)
        for c in self._busy:
            c.spin = self._spin if len(self._busy) == 1 else None

    def _take_back(self, conn: AsyncConnection) -> None:
        self._busy.discard(conn)
        conn.spin = None
        if len(self._busy) == 1:
            next(iter(self._busy)).spin = self._spin

    def _give_back(self, conn: AsyncConnection) -> None:
        if conn.closed:
            return
        if len(self._idle) < self.pool_size and not self._closed:
            self._idle.append(conn)
        else:
            conn.close()

    async def _run(self, fn, *args):
        """await fn(conn, *args); on a dead connection (daemon restarted) retry once."""
        for attempt in (0, 1):
            try:
                async with self._conn() as conn:
                    return await fn(conn, *args)
            except Exception as e:
                raise_unless_retryable(e, attempt, self.addr)
                self._drop_idle()

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def _call(self, msg: w.Message):
        await self._flush_puts()

        async def op(conn: AsyncConnection):
            await conn.flush_releases()
            return (await conn.call(msg))[0]
        return await self._run(op)

    # ------------------------------------------------------------ writes

    async def put_n(self, hashes: Sequence[bytes], srcs) -> list[PutStatus]:
        """Store blocks (see `Client.put_n`); on the daemon's host with no request while
        the put channel's grants last."""
        if len(hashes) == 1 and (at := host_address(srcs, self.block_bytes)) is not None:
            # one CPU tensor's block: copied by address, no rows made (as Client.put_n)
            await self.connect()
            puts = await self._direct_puts()
            done = None if puts is None else puts.put_one_at(hashes[0], at)
            if done is not None:
                await asyncio.sleep(0)  # (no request: see _read_direct)
                return done
        rows = host_rows(srcs, len(hashes), self.block_bytes, writable=False)  # (Client.put_n)
        if rows is None:
            rows = byte_rows(srcs, len(hashes), self.block_bytes)
        if not len(hashes):
            return []
        await self.connect()
        puts = await self._direct_puts()
        if puts is not None:
            done = puts.put_n(hashes, rows)
            if done is not None:
                await asyncio.sleep(0)  # (no request: see _read_direct)
                return done
        return await self._run(self._put_n, w.pack_hashes(hashes), rows)

    async def _direct_puts(self) -> DirectPuts | None:
        await self._follow_loop()
        arena = self._arena
        if not self.direct_puts or arena is None or arena.directory is None or self._closed:
            return None
        if self._puts is not None and self._puts.arena is arena and not self._puts.ended:
            return self._puts
        async with self._lock():
            if self._puts is not None and self._puts.arena is arena and not self._puts.ended:
                return self._puts
            if self._closed or arena is not self._arena:
                return None  # closed meanwhile (close() unmapped the arena): by request,
                # which says so
            await self._drop_puts_locked()
            if self._local is None:
                return None  # the daemon went away: by request until one finds it again
            conn = None
            try:
                conn = await self._open(self._local)
                reply, fds = await conn.call_fds(w.Puts(), 2)
                self._puts, self._puts_conn = DirectPuts(reply, fds, arena), conn
            except (w.RemoteError, w.ProtocolError):
                if conn is not None:
                    conn.close()
                self.direct_puts = False  # e.g. no DRAM tier there: requests it is
                return None
            except (ConnectError, RequestTimeout, OSError):
                # (it turned direct puts off for good, and an AttributeError followed once
                # the local address was forgotten: see Client._direct_puts)
                if conn is not None:
                    conn.close()
                self._local = None  # found again by the next new connection (_new_conn)
                return None
            except BaseException:  # cancelled: the connection may be mid-reply
                if conn is not None:
                    conn.close()
                raise
            return self._puts

    def _lock(self) -> asyncio.Lock:
        if self._puts_lock is None:
            self._puts_lock = asyncio.Lock()
        return self._puts_lock

    async def _flush_puts(self) -> None:
        """What this client put with no request is committed before its next request.
        A FLUSH that fails, times out or is cancelled ends the channel unflushed (its
        connection may be one reply behind: a FLUSH cancelled mid-wait left it so, and every
        later FLUSH read the one before's reply, the gets after it missing blocks just put
        and removed blocks coming back); a timeout is raised, as a cancellation is."""
        await self._follow_loop()
        if self._puts is None or not self._puts.pending():
            return
        async with self._lock():
            if self._puts is None or not self._puts.pending():
                return
            try:
                await self._puts_conn.call(w.Flush())
            except RequestTimeout:  # (an OSError: first)
                await self._drop_puts_locked(flush=False)
                raise
            except (ConnectionError, OSError, w.ProtocolError, w.RemoteError):
                await self._drop_puts_locked(flush=False)  # the daemon went away; it
                # committed what it had
            except BaseException:  # cancelled
                await self._drop_puts_locked(flush=False)
                raise

    async def _drop_puts_locked(self, flush: bool = True) -> None:
        puts, conn = self._puts, self._puts_conn
        self._puts = self._puts_conn = None
        if puts is None:
            return
        try:
            if flush and puts.pending():
                await conn.call(w.Flush())
        except (ConnectionError, OSError, RequestTimeout, w.ProtocolError, w.RemoteError):
            pass
        finally:
            conn.close()
            puts.close()

    async def _put_n(self, conn: AsyncConnection, packed: bytes, rows) -> list[PutStatus]:
        await conn.flush_releases()
        arena = self._arena if conn.local else None
        n, stage_limit = len(packed) // 16, min(self.staged_put_bytes, MAX_STAGE_BYTES)
        if arena is not None and n * self.block_bytes <= stage_limit:
            stage(await conn.staging(stage_limit), rows, n, self.block_bytes)
            reply, _ = await conn.call(w.Put(hashes=packed, staged=True))
            return put_statuses(reply.statuses)
        if arena is None:
            reply, _ = await conn.call(w.Put(hashes=packed), payload_views(rows))
            return put_statuses(reply.statuses)
        res, _ = await conn.call(w.Reserve(hashes=packed))
        slots = np.frombuffer(res.slots, "<i8")
        inline = []
        try:
            for i, (status, slot) in enumerate(zip(res.statuses, slots.tolist())):
                if status == 0 and slot >= 0:
                    copy_row(arena.rows[slot], rows[i])
                elif status == 0:
                    inline.append(as_numpy(rows[i]))
        except BaseException:
            try:
                await conn.call(w.Abort(reservation_id=res.reservation_id))
            except Exception:  # its own failure must not hide why the put failed: the
                conn.close()  # connection's end gives the reservation back all the same
            raise
        try:
            await conn.call(w.Commit(reservation_id=res.reservation_id), inline)
        except w.RemoteError as e:
            if e.code is not w.ErrorCode.NO_SPACE:
                raise
            return [PutStatus.NO_SPACE if s == 0 else st
                    for s, st in zip(res.statuses, put_statuses(res.statuses))]
        return put_statuses(res.statuses)

    async def put(self, key: bytes, value) -> PutStatus:
        return (await self.put_n([key], [value]))[0]

    # ------------------------------------------------------------ reads

    async def get_n(self, hashes: Sequence[bytes], dsts) -> list[TierKind | None]:
        """Copy each stored block into its destination (see `Client.get_n`): the tier it
        was found in, or None for a miss."""
        n = len(hashes)
        if not n:
            byte_rows(dsts, n, self.block_bytes, writable=True)  # still says what is wrong
            return []
        await self.connect()
        await self._flush_puts()
        rows = read_rows(dsts, n, self.block_bytes, self._direct_ok(), VECTOR_READS)
        tiers, missed = await self._read_direct(hashes, rows, False)
        if missed:
            rows = request_rows(rows, dsts, n, self.block_bytes)
            found = await self._run(self._get_n, w.pack_hashes([hashes[i] for i in missed]),
                                    select_rows(rows, missed))
            for i, t in zip(missed, found):
                tiers[i] = t
        else:
            await asyncio.sleep(0)  # (no request: see _read_direct)
        return tiers

    def _direct_ok(self) -> bool:
        """Is the arena's slot directory mapped here (same host, reads with no request)?"""
        return self._arena is not None and self._arena.directory is not None

    async def _read_direct(self, hashes, rows, prefix: bool):
        """The blocks the slot directory shows in DRAM, copied with no request (same host):
        (tiers, indices left for the daemon). A call answered this way alone (and a put the
        put channel takes) gives the event loop a turn before it returns: with no request
        to wait for, a task looping over them had kept every other task of the loop out."""
        arena = self._arena
        if not self._direct_ok() or not arena.directory.writer_alive():
            return [None] * len(hashes), list(range(len(hashes)))
        tiers, missed, touched = arena.read_direct(hashes, rows, prefix)
        sent = self._touch_task
        if touched and self._touches.add(touched) and (sent is None or sent.done()):
            # (one TOUCH in flight at most: a hung daemon chained one more per read that
            # fell due, each waiting timeout_s, and close() waited for them all)
            batch = self._touches.take()
            if batch is not None:  # sent beside the reads that follow, not waited for here
                self._touch_task = asyncio.ensure_future(self._send_touch(batch))
        return tiers, missed

    async def _send_touch(self, batch: w.Touch) -> bool:
        """One TOUCH (one in flight at a time: they land in order); whether the daemon
        answered."""
        try:
            await self._call(batch)
            return True
        except (ConnectError, RequestTimeout, w.RemoteError):
            return False  # only statistics and recency are lost

    async def _send_touches(self) -> None:
        """Direct reads send nothing; the daemon learns of them (hits, LRU recency) in
        TOUCH requests (see `TouchLog`), best effort: the one in flight lands, then
        whatever waits goes."""
        before, self._touch_task = self._touch_task, None
        if before is not None:
            await asyncio.wait([before])
            if before.cancelled() or before.exception() is not None or not before.result():
                return  # unanswered: the rest would each wait as long
        while (batch := self._touches.take(everything=True)) is not None:
            if not await self._send_touch(batch):
                return

    async def _get_n(self, conn: AsyncConnection, packed: bytes, rows,
                     prefix: bool = False) -> list[TierKind | None]:
        arena = self._arena if conn.local else None
        release, conn.pending_release = tuple(conn.pending_release), []
        host = host_rows(rows, len(packed) // 16, self.block_bytes)
        sent_at = time.monotonic()
        reply, payload_bytes = await conn.call(w.Get(hashes=packed, release=release,
                                                     prefix=prefix, shm=arena is not None))
        tiers, inline, leased, slots = get_layout(reply, payload_bytes, self.block_bytes)
        for i in inline:
            view, staging = row_view(rows, host, i)
            await conn.recv_into(view)
            if staging is not None:
                copy_row(rows[i], staging)
        if reply.lease_id:
            try:
                for i in leased:
                    copy_row(rows[i], arena.rows[int(slots[i])])
            finally:
                conn.pending_release.append(reply.lease_id)
            drop_late_copies(tiers, leased, sent_at, conn.info)
        return tiers

    async def get_prefix_n(self, hashes: Sequence[bytes], dsts) -> MatchResult:
        """The longest stored prefix of `hashes`, its blocks copied into the first
        destinations, in one round trip (none for a prefix shown in DRAM on this host)."""
        n = len(hashes)
        if not n:
            byte_rows(dsts, n, self.block_bytes, writable=True)  # still says what is wrong
            return MatchResult(0, ())
        await self.connect()
        await self._flush_puts()
        rows = read_rows(dsts, n, self.block_bytes, self._direct_ok(), VECTOR_READS)
        tiers, missed = await self._read_direct(hashes, rows, True)
        tiers = tiers[:missed[0]] if missed else tiers
        start = len(tiers)
        if start < n:
            tiers += await self._run(self._get_n, w.pack_hashes(hashes[start:]),
                                     select_rows(request_rows(rows, dsts, n, self.block_bytes),
                                                 range(start, n)), True)
        else:
            await asyncio.sleep(0)  # (no request: see _read_direct)
        hit = leading_hits(tiers)
        return MatchResult(hit, tuple(tiers[:hit]))

    async def get_into(self, key: bytes, buffer) -> TierKind | None:
        return (await self.get_n([key], [buffer]))[0]

    async def get(self, key: bytes) -> bytes | None:
        out = bytearray(self.block_bytes)
        return bytes(out) if (await self.get_n([key], [out]))[0] is not None else None

    # ------------------------------------------------------------ metadata

    async def contains_n(self, hashes: Sequence[bytes]) -> list[bool]:
        return flags_of(await self._call(w.Exists(hashes=w.pack_hashes(hashes))))

    async def match_prefix(self, hashes: Sequence[bytes]) -> MatchResult:
        return match_of(await self._call(w.Match(hashes=w.pack_hashes(hashes))))

    async def remove_n(self, hashes: Sequence[bytes]) -> int:
        """Drop blocks from every tier (see `Client.remove_n`); this client's lingering
        leases are released first."""
        idle, self._idle = self._idle, []
        for conn in idle:
            try:
                await conn.flush_releases()
            except (ConnectionError, OSError, w.ProtocolError, RequestTimeout):
                conn.close()
                continue
            self._give_back(conn)
        return (await self._call(w.Remove(hashes=w.pack_hashes(hashes)))).value

    async def remove(self, key: bytes) -> bool:
        return await self.remove_n([key]) == 1

    async def pin_n(self, hashes: Sequence[bytes], ttl_s: float | None = None) -> list[bool]:
        return flags_of(await self._call(w.Pin(hashes=w.pack_hashes(hashes), ttl_s=ttl_s)))

    async def unpin_n(self, hashes: Sequence[bytes]) -> None:
        await self._call(w.Unpin(hashes=w.pack_hashes(hashes)))

    async def stats(self) -> StoreStats:
        await self._send_touches()  # so the hit counts include this client's direct reads
        return stats_of(await self._call(w.Stats()), self.ns)

    @property
    def transport(self) -> str:
        """"shm" (the daemon's arena, same host) or "tcp" (inline in the frames)."""
        return "shm" if self._arena is not None else "tcp"

    @property
    def uses_shm(self) -> bool:
        return self._arena is not None

    async def close(self) -> None:
        """End this client, as `Client.close`: a request another task has in flight is cut
        short (ConnectError now, not after timeout_s), what this client put with no request
        is flushed first."""
        if self._closed:
            return
        await self._follow_loop()
        if self._connected:
            await self._send_touches()
        self._closed = True
        cut(list(self._busy))  # (the put channel's is not one: flushed next)
        if self._connected:
            async with self._lock():
                await self._drop_puts_locked()
        self._drop_idle()
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()
