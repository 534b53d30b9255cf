"""`Client`: the blocking SDK for one `kvtier serve` daemon and one namespace.

Same semantics as `TieredStore` for the engine-facing names (`put_n`, `get_n`,
`contains_n`, `match_prefix`), so an engine connector can swap an in-process store for a
client. Thread-safe: each call borrows a pooled connection. A call that finds its
connection dead (daemon restarted) retries once on a fresh one; a daemon that cannot be
reached raises `ConnectError`, a silent one `RequestTimeout`.
"""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from kvstore import wire as w
from kvstore.buffers import (byte_rows, host_address, host_rows, read_rows, request_rows,
                             select_rows)
from kvstore.client.conn import Connection, LocalAddress, cut, parse_url
from kvstore.client.errors import ConnectError, RequestTimeout
from kvstore.client.agentpath import AgentPath
from kvstore.client import forks
from kvstore.client.putpath import DirectPuts
from kvstore.client.replies import (INLINE_GET_BYTES, INLINE_PUT_BYTES, MAX_STAGE_BYTES,
                                    SPIN_US, STAGED_PUT_BYTES, TouchLog, as_numpy, check_timeouts,
                                    copy_row, drop_late_copies, flags_of, get_layout,
                                    match_of, payload_views,
                                    put_statuses, stage, raise_unless_retryable,
                                    reusable_after, row_view, stats_of)
from kvstore.client.shm import VECTOR_READS, ArenaMap, map_arena
from kvstore.putring import DIRECT_PUTS
from kvstore.events import TierKind
from kvstore.keys import Namespace
from kvstore.stats import StoreStats
from kvstore.api import MatchResult, PutStatus, leading_hits
from transfer import BackendKind, TransferError

# what a call met when close() in another thread unmapped the memory it was using (see
# Client._closed_meanwhile)
CLOSE_RACE = (ValueError, TypeError, AttributeError, BufferError)


class Client:
    def __init__(self, url: str, token: str = "", namespace: Namespace | None = None, *,
                 timeout_s: float = 30.0, connect_timeout_s: float = 5.0, pool_size: int = 8,
                 use_shm: bool = True, inline_put_bytes: int = INLINE_PUT_BYTES,
                 inline_get_bytes: int | None = None,
                 staged_put_bytes: int = STAGED_PUT_BYTES, use_agent: bool = False,
                 agent_backends: Sequence[BackendKind | str] = (BackendKind.TCP,),
                 direct_puts: bool = True, spin_us: float = SPIN_US) -> None:
        """`use_agent`: off the daemon's host, move block bytes with a transfer Agent
        (one-sided READ/WRITE of the daemon's arena through `agent_backends`, e.g. nixl for
        RDMA) instead of inline in the frames; puts and gets of at most `inline_put_bytes` /
        `inline_get_bytes` still go inline (one request: cheaper than the agent's two;
        `inline_get_bytes` None: INLINE_GET_BYTES, every get where the agent's backend is
        tcp). On the daemon's host shared memory wins.

        `spin_us`: microseconds a connection (the agent's too) polls for a reply before
        it sleeps (0: sleep at once). A reply that comes meanwhile is read without the
        CPU's wake-up (tens of us on VMs: a 256 KiB TCP get 146 -> 50 us at p50 with the
        daemon polling too); at most that much CPU per request, and an idle connection
        soon stops polling."""
        if namespace is None:
            raise ValueError("Client needs namespace=Namespace(model, num_layers, num_kv_heads, "
                             "head_dim, ...): the model whose KV blocks it stores")
        check_timeouts(timeout_s, connect_timeout_s)
        self.addr, self.token, self.ns = parse_url(url), token, namespace
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.spin_us = spin_us
        self.pool_size, self.use_shm = pool_size, use_shm
        self.inline_put_bytes = inline_put_bytes  # off-host agent puts this small go inline
        self.inline_get_bytes = inline_get_bytes  # and gets (None: see _inline_get)
        self.staged_put_bytes = staged_put_bytes  # same-host puts this small go staged
        self.use_agent = use_agent
        self.agent_backends = tuple(BackendKind(b) for b in agent_backends)
        self._agent: AgentPath | None = None
        self._idle: list[Connection] = []
        self._made: weakref.WeakSet[Connection] = weakref.WeakSet()  # every one still open
        self._aborted = False  # abort_calls: no call goes out any more
        self._lock = threading.Lock()
        self._arena: ArenaMap | None = None
        self._local: LocalAddress | None = None  # the daemon's local socket, once found
        self._puts: DirectPuts | None = None
        self._puts_opening = threading.Lock()  # one thread opens the put channel at a time
        self.direct_puts = use_shm and direct_puts and DIRECT_PUTS
        self._touches = TouchLog()  # direct reads the daemon has not heard of yet
        self._toucher: ThreadPoolExecutor | None = None  # sends TOUCH batches off the read path
        self._touch_sent: Future | None = None
        self._closed = False
        self.block_bytes = namespace.block_bytes
        forks.track(self)
        with self._conn():  # fail fast: wrong address, token or namespace
            pass

    def _after_fork(self) -> None:
        """In a child made by os.fork() (kvstore.client.forks): this process's copies of
        the parent's connections (idle or in another thread's call at the fork: open here,
        the daemon never saw the parent close them), put channel, arena mapping and touch
        helper go, none of them used (the parent still is); the next call connects afresh."""
        self._lock, self._puts_opening = threading.Lock(), threading.Lock()
        idle, self._idle = list(self._made), []
        self._made = weakref.WeakSet()
        puts, self._puts = self._puts, None
        arena, self._arena = self._arena, None
        self._agent = None  # (closed in this process: transfer.agent, at fork)
        self._touches, self._toucher, self._touch_sent = TouchLog(), None, None
        for conn in idle:
            conn.close()  # (only this process's descriptor: the socket stays the parent's)
        if puts is not None:
            puts.forget()
        if arena is not None:
            arena.close()

    # ------------------------------------------------------------ connections

    def _new_conn(self) -> Connection:
        """A connection over the local socket when this client found the daemon on its
        host, else over TCP (which tells where the local socket is, if there is one)."""
        conn = None
        if self._local is not None:
            try:
                conn = self._connect(self._local)
            except ConnectError:
                self._local = None  # the daemon restarted (a new socket): find it again
        if conn is None:
            conn = self._connect(self.addr)
            if self.use_shm and conn.info.local_socket:
                conn = self._go_local(conn)
        try:
            self._check_arena(conn)
        except BaseException:
            conn.close()
            raise
        with self._lock:  # (abort_calls reads it from another thread)
            self._made.add(conn)
        return conn

    def _connect(self, addr) -> Connection:
        agent = self._agent
        return Connection(addr, self.token, self.ns, self.timeout_s, self.connect_timeout_s,
                          want_agent=self.use_agent,
                          agent_key=agent.access_key if agent is not None else b"",
                          spin_us=self.spin_us)

    def _go_local(self, tcp: Connection) -> Connection:
        """The same daemon over its local socket, when this process can reach it (same host
        and network namespace); otherwise `tcp` as it is."""
        local = LocalAddress(tcp.info.local_socket)
        try:
            conn = self._connect(local)
        except (ConnectError, w.RemoteError, OSError):
            return tcp  # another host: TCP it is
        if conn.info.instance != tcp.info.instance:
            conn.close()  # not the daemon we authenticated with over TCP
            return tcp
        tcp.close()
        self._local = local
        return conn

    def _check_arena(self, conn: Connection) -> None:
        """Map the namespace's arena (local connections) the first time, or again after the
        daemon replaced it; off the host, set up the transfer agent instead."""
        info = conn.info
        with self._lock:
            current = self._arena is not None and self._arena.arena_id == info.arena_id
        if conn.local and current:
            return
        arena = map_arena(conn, self.block_bytes) if conn.local else None
        with self._lock:
            closed = self._closed
            if not closed:
                old, self._arena = self._arena, arena
        if closed:  # a call that began before close(): mapping the arena again had let every
            # read after close() go on from it with no request, never told the client is closed
            if arena is not None:
                arena.close()
            raise ConnectError("this Client is closed (by another thread, during this call)")
        if old is not None:
            old.close()
        if arena is None and self.use_agent and info.agent_meta:
            self._check_agent(info)

    def _movers(self, conn: Connection) -> tuple[ArenaMap | None, AgentPath | None]:
        """What moves block bytes on `conn`: the arena mapping (a local connection) or the
        transfer agent (None, None: inline in the frames)."""
        arena, agent = (self._arena if conn.local else None), self._agent
        if arena is None and agent is not None and agent.broken:
            raise ConnectionError("the daemon's transfer agent went away")  # retried afresh
        return arena, agent

    def _check_agent(self, info: w.HelloOk) -> None:
        with self._lock:
            if self._agent is not None and self._agent.meta == info.agent_meta \
                    and self._agent.access_key == info.agent_key and not self._agent.broken:
                return
            old, self._agent = self._agent, None
        if old is not None:
            old.close()
        try:
            path = AgentPath(info, self.agent_backends, self.timeout_s, self.spin_us,
                             self.connect_timeout_s)
        except TransferError as e:
            raise ConnectError(f"cannot reach the daemon's transfer agent through "
                               f"{[b.value for b in self.agent_backends]}: {e}") from e
        with self._lock:
            closed = self._closed
            if not closed:
                self._agent = path
        if closed:  # (as _check_arena's)
            path.close()
            raise ConnectError("this Client is closed (by another thread, during this call)")

    @contextmanager
    def _conn(self) -> Iterator[Connection]:
        conn = self._take()
        try:
            yield conn
        except BaseException as e:
            self._put_back(conn, e)
            raise
        self._put_back(conn)

    def _take(self) -> Connection:
        """An idle pooled connection, or a new one."""
        if self._closed:
            raise ConnectError("this Client is closed")
        if self._aborted:
            raise ConnectError(f"calls to {self.addr} were cut (abort_calls)")
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        return conn or self._new_conn()

    def _put_back(self, conn: Connection, error: BaseException | None = None) -> None:
        """Back to the pool after a call, unless `error` left it mid-frame (then closed)."""
        if error is None or reusable_after(error):
            self._give_back(conn)
        else:
            conn.close()

    def _give_back(self, conn: Connection) -> None:
        if conn.closed:
            return
        with self._lock:
            if len(self._idle) < self.pool_size and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _run(self, fn, *args):
        """Run fn(conn, *args); on a dead connection (daemon restarted) retry once. (`_conn`
        spelled out: a generator context manager cost ~3 us a call.)"""
        for attempt in (0, 1):
            try:
                conn = self._take()
                try:
                    out = fn(conn, *args)
                except BaseException as e:
                    self._put_back(conn, e)
                    raise
                self._put_back(conn)
                return out
            except Exception as e:
                raise_unless_retryable(e, attempt, self.addr)
                self._drop_idle()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ------------------------------------------------------------ writes

    def put_n(self, hashes: Sequence[bytes], srcs) -> list[PutStatus]:
        """Store blocks (one buffer of len(hashes) blocks, or one buffer per block). On the
        daemon's host, with no request at all while the daemon's grants last (see
        kvstore.client.putpath); the blocks are visible to this client's next request."""
        n = len(hashes)
        try:
            if n == 1 and (at := host_address(srcs, self.block_bytes)) is not None:
                # one CPU tensor's block on the daemon's host: copied by address (its
                # .numpy(), the rows' checks and views were ~5 us of a ~40 us 256 KiB put)
                puts = self._direct_puts()
                done = None if puts is None else self._put_direct(puts, hashes, at)
                if done is not None:
                    return done
        except CLOSE_RACE as e:
            raise self._closed_meanwhile(e)
        # host sources as one numpy [n, bytes] view: every path copies or sends from it with
        # no torch view op (those took ~4 us of a ~30 us same-host 256 KiB put); anything
        # else is checked by byte_rows and goes the same ways as tensors
        rows = host_rows(srcs, n, self.block_bytes, writable=False)
        if rows is None:
            rows = byte_rows(srcs, n, self.block_bytes)
        if not n:
            return []
        try:
            puts = self._direct_puts()
            if puts is not None:
                done = self._put_direct(puts, hashes, rows)
                if done is not None:
                    return done
            return self._run(self._put_n, w.pack_hashes(hashes), rows)
        except CLOSE_RACE as e:
            raise self._closed_meanwhile(e)

    def _closed_meanwhile(self, e: Exception) -> Exception:
        """What to raise for `e`, an error of a call that `close()` (in another thread) may
        have cut short by unmapping what it was copying (the arena, the slot directory, the
        put ring): ConnectError, as any call on a closed Client gets, where it was closed;
        `e` itself where not. (The errors such a call met were a released memoryview's
        ValueError or a TypeError of a mapping set to None.)"""
        if self._closed:
            return ConnectError("this Client is closed (by another thread, during this call)")
        return e

    def _put_direct(self, puts: DirectPuts, hashes: Sequence[bytes], rows) -> list[PutStatus] | None:
        """`puts.put_n` (`put_one_at` where `rows` is an address), or None when its channel
        broke (the daemon went away mid-put: its FLUSH failed): the put goes by request,
        which reconnects or raises ConnectError, never a bare socket error."""
        try:
            if type(rows) is int:
                return puts.put_one_at(hashes[0], rows)
            return puts.put_n(hashes, rows)
        except RequestTimeout:  # (its FLUSH: a request would wait as long again)
            self._drop_puts(flush=False, failed=puts)
            raise
        except (ConnectionError, OSError, w.ProtocolError, w.RemoteError):
            self._drop_puts(flush=False, failed=puts)
            return None

    def _direct_puts(self) -> DirectPuts | None:
        """This client's put channel (opened on first use), when it may put with none."""
        arena = self._arena
        if not self.direct_puts or arena is None or arena.directory is None:
            return None
        puts = self._puts
        if puts is not None and puts.arena is arena and not puts.ended:
            return puts
        # (one opener at a time: threads making their first puts together each opened a
        # channel, the last one kept, and the puts through the others were never flushed,
        # a thread's get missing the block it had just put)
        with self._puts_opening:
            puts, local = self._puts, self._local
            if puts is not None and puts.arena is arena and not puts.ended:
                return puts
            if self._closed:
                return None
            self._drop_puts()
            if local is None:
                return None  # the daemon went away: by request until one finds it again
            try:
                puts = DirectPuts.open(self._connect(local), arena)
            except (w.RemoteError, w.ProtocolError):
                self.direct_puts = False  # e.g. no DRAM tier there: requests it is
                return None
            except (ConnectError, RequestTimeout, OSError):
                # (it used to turn direct puts off for good, and a TypeError followed once
                # the local address was forgotten: a client that only put never recovered
                # from a daemon's restart)
                self._local = None  # found again by the next new connection (_new_conn)
                return None
            with self._lock:
                self._puts = puts
            return puts

    def _flush_puts(self) -> None:
        """What this client put with no request is committed before its next request.
        Raises RequestTimeout when the daemon did not commit them in time (the channel is
        dropped unflushed: flushing it again waited one more timeout, and the request after
        it a third)."""
        puts = self._puts
        if puts is None:
            return
        try:
            puts.flush()
        except RequestTimeout:  # (an OSError: first)
            self._drop_puts(flush=False, failed=puts)
            raise
        except (ConnectionError, OSError, w.ProtocolError, w.RemoteError):
            self._drop_puts(flush=False, failed=puts)  # the daemon went away; it
            # committed what it had

    def _drop_puts(self, flush: bool = True, failed: DirectPuts | None = None) -> None:
        """End the put channel. With `failed` (a channel whose FLUSH failed), end that one,
        and forget it only if it is still this client's: a thread whose FLUSH failed late
        must not end a channel another thread has opened since."""
        with self._lock:
            puts = self._puts
            if failed is not None and puts is not failed:
                puts = failed  # (ended all the same: its connection is in doubt)
            else:
                self._puts = None
        if puts is not None:
            try:
                puts.close(flush)
            except (ConnectionError, OSError, RequestTimeout, w.ProtocolError, w.RemoteError):
                pass

    def _put_n(self, conn: Connection, packed: bytes, rows) -> list[PutStatus]:
        conn.flush_releases()
        arena, agent = self._movers(conn)
        n, stage_limit = len(packed) // 16, min(self.staged_put_bytes, MAX_STAGE_BYTES)
        if arena is not None and n * self.block_bytes <= stage_limit:
            # sized once for any put that stages
            stage(conn.staging(stage_limit), rows, n, self.block_bytes)
            reply, _ = conn.call(w.Put(hashes=packed, staged=True))
            return put_statuses(reply.statuses)
        if arena is None and (agent is None or n * self.block_bytes <= self.inline_put_bytes):
            reply, _ = conn.call(w.Put(hashes=packed), payload_views(rows))
            return put_statuses(reply.statuses)
        res, _ = conn.call(w.Reserve(hashes=packed))
        slots = np.frombuffer(res.slots, "<i8")
        inline, moved = [], []
        try:
            for i, (status, slot) in enumerate(zip(res.statuses, slots.tolist())):
                if status == 0 and slot >= 0:
                    if arena is not None:
                        copy_row(arena.rows[slot], rows[i])
                    else:
                        moved.append((slot, i))
                elif status == 0:
                    inline.append(as_numpy(rows[i]))
            if moved:
                idx = [i for _, i in moved]
                agent.write([slot for slot, _ in moved], [rows[i] for i in idx],
                            rows if isinstance(rows, np.ndarray) else None, idx)
        except BaseException:
            try:
                conn.call(w.Abort(reservation_id=res.reservation_id))
            except Exception:  # its own failure must not hide why the put failed: the
                conn.close()  # connection's end gives the reservation back all the same
            raise
        try:
            conn.call(w.Commit(reservation_id=res.reservation_id), inline)
        except w.RemoteError as e:
            if e.code is not w.ErrorCode.NO_SPACE:
                raise
            return [PutStatus.NO_SPACE if s == 0 else st
                    for s, st in zip(res.statuses, put_statuses(res.statuses))]
        return put_statuses(res.statuses)

    def put(self, key: bytes, value) -> PutStatus:
        return self.put_n([key], [value])[0]

    # ------------------------------------------------------------ reads

    def get_n(self, hashes: Sequence[bytes], dsts) -> list[TierKind | None]:
        """Copy each stored block into its destination (one writable buffer of all blocks
        or one per block: tensors, numpy arrays, bytearrays). Returns the tier each block
        was found in, or None for a miss (whose destination holds nothing usable: usually
        what it held before, but a same-host copy that lost a race may have written it).

        On the daemon's host, DRAM blocks published in its slot directory are copied with
        no request at all; the rest go to the daemon in one request."""
        arena = self._arena
        directory = arena.directory if arena is not None else None
        n = len(hashes)
        rows = read_rows(dsts, n, self.block_bytes, directory is not None, VECTOR_READS)
        if not n:
            return []
        try:
            self._flush_puts()  # this client's puts readable first (a memory read if none wait)
            if directory is None or not directory.writer_alive():
                return self._run(self._get_n, w.pack_hashes(hashes),
                                 request_rows(rows, dsts, n, self.block_bytes))
            tiers, missed = self._direct_reads(arena, hashes, rows)
            if missed:
                rows = request_rows(rows, dsts, n, self.block_bytes)
                found = self._run(self._get_n, w.pack_hashes([hashes[i] for i in missed]),
                                  [rows[i] for i in missed])
                for i, t in zip(missed, found):
                    tiers[i] = t
            return tiers
        except CLOSE_RACE as e:
            raise self._closed_meanwhile(e)

    def _direct_reads(self, arena: ArenaMap, hashes: Sequence[bytes], rows,
                      prefix: bool = False) -> tuple[list[TierKind | None], list[int]]:
        """`ArenaMap.read_direct`, its hits queued for the next TOUCH (sent once a batch
        is due)."""
        tiers, missed, touched = arena.read_direct(hashes, rows, prefix)
        if touched:
            with self._lock:
                due = self._touches.add(touched)
            sent = self._touch_sent
            if due and (sent is None or sent.done()):  # one TOUCH in flight at most: a hung
                # daemon queued one more per read that fell due, each waiting timeout_s, and
                # close() waited for them all (16 reads: 31 s at timeout_s=2)
                batch = self._due_touches()
                if batch:
                    self._touch_later(batch)
        return tiers, missed

    def _touch_later(self, batch: w.Touch) -> None:
        """Send a TOUCH batch from a helper thread: a read that happens to fill a batch
        does not wait the round trip (~0.3-0.8 ms for 256 blocks, measured)."""
        with self._lock:
            if self._closed:
                return
            if self._toucher is None:
                self._toucher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-touch")
            try:
                self._touch_sent = self._toucher.submit(self._send_touches, batch)
            except RuntimeError:
                pass  # close() is shutting the helper down: only statistics are lost

    def _touches_landed(self) -> None:
        """Every TOUCH batch handed to the helper thread has been answered."""
        sent = self._touch_sent
        if sent is not None:
            sent.exception()  # waits; a failed batch only loses statistics and recency

    def _due_touches(self, everything: bool = False) -> w.Touch | None:
        """Direct reads send nothing; the daemon learns of them (hit counts, LRU recency) in
        TOUCH requests (see `TouchLog`), best effort: the one due now (or, with
        `everything`, whatever is pending), if any."""
        with self._lock:
            return self._touches.take(everything)

    def _send_all_touches(self) -> None:
        """Whatever waits, until one TOUCH fails (the daemon is gone or hung: the rest would
        each wait as long)."""
        while (batch := self._due_touches(everything=True)) is not None:
            if not self._send_touches(batch):
                return

    def _send_touches(self, batch: w.Touch) -> bool:
        """One TOUCH; whether the daemon answered it."""
        try:
            self._call(batch)
            return True
        except (ConnectError, RequestTimeout, w.RemoteError):
            return False  # only statistics and recency are lost


    def _get_n(self, conn: Connection, packed: bytes, rows,
               prefix: bool = False) -> list[TierKind | None]:
        """One GET: leased DRAM slots are copied here (arena or transfer agent), the other
        hits arrive inline after the reply."""
        arena, agent = self._movers(conn)
        if arena is None and agent is not None and self._inline_get(agent, len(packed) // 16):
            agent = None
        release, conn.pending_release = tuple(conn.pending_release), []
        sent_at = time.monotonic()
        conn.send(w.Get(hashes=packed, release=release, prefix=prefix,
                        shm=arena is not None or agent is not None))
        # while the daemon works, not after its reply: host rows as one numpy view (a 256
        # KiB get over TCP took ~20 us less at p50 than converting each row on arrival)
        host = host_rows(rows, len(packed) // 16, self.block_bytes)
        reply, payload_bytes = conn.receive(w.Op.GET)
        tiers, inline, leased, slots = get_layout(reply, payload_bytes, self.block_bytes)
        for i in inline:
            view, staging = row_view(rows, host, i)
            conn.recv_into(view)
            if staging is not None:
                copy_row(rows[i], staging)
        if reply.lease_id:
            try:
                if arena is not None:
                    for i in leased:
                        copy_row(rows[i], arena.rows[int(slots[i])])
                else:
                    agent.read([int(slots[i]) for i in leased], [rows[i] for i in leased],
                               host, leased)
            finally:
                conn.pending_release.append(reply.lease_id)
            drop_late_copies(tiers, leased, sent_at, conn.info)
        return tiers

    def _inline_get(self, agent: AgentPath, n: int) -> bool:
        """Whether a get of n blocks off the daemon's host comes inline in GET's reply
        rather than by the transfer agent (see INLINE_GET_BYTES)."""
        limit = self.inline_get_bytes
        if limit is None:
            return agent.over_tcp or n * self.block_bytes <= INLINE_GET_BYTES
        return n * self.block_bytes <= limit

    def get_prefix_n(self, hashes: Sequence[bytes], dsts) -> MatchResult:
        """`match_prefix` and `get_n` in one round trip (none at all for a prefix the slot
        directory shows in DRAM on the daemon's host): the longest stored prefix of
        `hashes`, its blocks copied into the first destinations."""
        arena = self._arena
        directory = arena.directory if arena is not None else None
        n = len(hashes)
        rows = read_rows(dsts, n, self.block_bytes, directory is not None, VECTOR_READS)
        if not n:
            return MatchResult(0, ())
        try:
            self._flush_puts()
            tiers: list[TierKind | None] = []
            if directory is not None and directory.writer_alive():
                tiers, missed = self._direct_reads(arena, hashes, rows, prefix=True)
                tiers = tiers[:missed[0]] if missed else tiers
            start = len(tiers)
            if start < len(hashes):
                tiers += self._run(self._get_n, w.pack_hashes(hashes[start:]),
                                   select_rows(request_rows(rows, dsts, n, self.block_bytes),
                                               range(start, n)), True)
        except CLOSE_RACE as e:
            raise self._closed_meanwhile(e)
        hit = leading_hits(tiers)
        return MatchResult(hit, tuple(tiers[:hit]))

    def get_into(self, key: bytes, buffer) -> TierKind | None:
        return self.get_n([key], [buffer])[0]

    def get(self, key: bytes) -> bytes | None:
        out = bytearray(self.block_bytes)
        return bytes(out) if self.get_n([key], [out])[0] is not None else None

    # ------------------------------------------------------------ metadata

    def contains_n(self, hashes: Sequence[bytes]) -> list[bool]:
        return flags_of(self._call(w.Exists(hashes=w.pack_hashes(hashes))))


    def match_prefix(self, hashes: Sequence[bytes]) -> MatchResult:
        return match_of(self._call(w.Match(hashes=w.pack_hashes(hashes))))

    def remove_n(self, hashes: Sequence[bytes]) -> int:
        """Drop blocks from every tier, pinned ones included; how many went. Blocks a reader
        holds at that moment stay, so this client's own lingering shm leases (released with
        each connection's next request) are released first, on every idle connection."""
        self._release_idle_leases()
        return self._call(w.Remove(hashes=w.pack_hashes(hashes))).value

    def _release_idle_leases(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            try:
                conn.flush_releases()
            except (ConnectionError, OSError, w.ProtocolError):
                conn.close()  # a dead connection's leases expire on the daemon
                continue
            self._give_back(conn)

    def remove(self, key: bytes) -> bool:
        return self.remove_n([key]) == 1

    def pin_n(self, hashes: Sequence[bytes], ttl_s: float | None = None) -> list[bool]:
        return flags_of(self._call(w.Pin(hashes=w.pack_hashes(hashes), ttl_s=ttl_s)))

    def unpin_n(self, hashes: Sequence[bytes]) -> None:
        self._call(w.Unpin(hashes=w.pack_hashes(hashes)))

    def stats(self) -> StoreStats:
        self._touches_landed()
        self._send_all_touches()  # so the hit counts include this client's direct reads
        return stats_of(self._call(w.Stats()), self.ns)

    @property
    def transport(self) -> str:
        """How block bytes move: "shm" (the daemon's arena over its local socket, same
        host), "agent" (a transfer Agent, one-sided) or "tcp" (inline in the frames)."""
        return "shm" if self._arena is not None else "agent" if self._agent is not None else "tcp"

    @property
    def uses_shm(self) -> bool:
        """True when blocks move through the daemon's shared-memory arena (same host)."""
        return self._arena is not None

    def _call(self, msg: w.Message):
        self._flush_puts()

        def op(conn: Connection):
            conn.flush_releases()
            return conn.call(msg)[0]
        return self._run(op)

    def abort_calls(self) -> None:
        """Shut down every connection of this client, those other threads' calls wait on
        too: those calls fail now (a connection error), not after timeout_s, and so does
        every call after (a retry had connected again and waited as long). (A pool client
        does this for a node that left the pool: one stopped had held its calls 30 s.)"""
        self._aborted = True
        self._cut_calls()

    def _cut_calls(self) -> None:
        """Shut down every connection still open, those calls in flight wait on too."""
        with self._lock:
            made = list(self._made)
        cut(made)

    def close(self) -> None:
        """End this client. A request another thread still has in flight is cut short: it
        raises ConnectError now, not after timeout_s (a close from another thread had left
        it waiting on a daemon that did not answer), as every later call does. What this
        client put with no request is flushed to the daemon (close waits for that, up to
        timeout_s, as does a call whose own flush of them is under way), its touches sent
        before."""
        if self._closed:
            return
        if self._toucher is not None:
            self._toucher.shutdown(wait=True)
        sent = self._touch_sent
        if sent is None or sent.exception() is not None or sent.result():
            self._send_all_touches()  # (not after one that went unanswered)
        with self._lock:  # (no thread maps the arena or opens the agent after this)
            self._closed = True
        self._cut_calls()  # (the put channel is not one of them: flushed next)
        with self._puts_opening:  # (no thread opens a put channel after this)
            self._drop_puts()
        self._drop_idle()
        with self._lock:
            arena, self._arena, agent, self._agent = self._arena, None, self._agent, None
        if arena is not None:
            arena.close()
        if agent is not None:
            agent.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

