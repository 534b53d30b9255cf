"""One data-plane connection: hello (auth + namespace), then ops on that namespace's store.

Runs on the connection's thread; every store call is synchronous (the store core is). Bulk
bytes go straight between the socket and DRAM arena slots the op has reserved or leased
(recv_into / sendmsg), through a scratch buffer only for SSD / GPU blocks.

Nothing but HELLO is served before a token has passed. Connections over the daemon's local
(Unix) socket are on the same host: there SHARE hands the namespace's DRAM arena and slot
directory to the client as file descriptors, and STAGE a per-connection staging segment;
over TCP both are refused.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import math
import mmap
import os
import socket
import struct
import termios
import threading
import time
from typing import Sequence

import numpy as np

from kvstore import wire as w
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.metrics import OpTally
from kvstore.daemon.namespaces import Hosted, Registry, namespace_of
from kvstore.daemon.putchannel import Drainer, PutChannel
from kvstore.errors import ReservationError, StoreClosedError, TierIOError
from kvstore.events import TierKind
from kvstore.reads import DEFERRED
from kvstore.store import PutStatus, Reservation
from transfer import ShmSegment

log = logging.getLogger("kvtier.session")
STATUS_CODES = {PutStatus.STORED: 0, PutStatus.EXISTS: 1, PutStatus.NO_SPACE: 2}
MAX_STAGE_BYTES = 64 << 20  # one connection's staging segment at most
MAX_STAGED_BYTES = 2 * MAX_STAGE_BYTES  # all its STAGEs together (a client grows its segment
# by asking again, for more each time: doubling sums under twice the last)
MAX_DESCRIPTOR_REPLIES = 16  # SHARE, STAGE and PUTS replies, per connection
SCRATCH_KEEP = 64 << 20  # scratch a connection keeps between requests (more is freed after use)
SCRATCH_KEEP_TOTAL = 256 << 20  # and all connections together: past it, each lets its own go
# after its request (30 connections idle after one 32 MiB GET of SSD blocks each kept 1 GiB,
# and the 768 connections a tenant may hold could keep 24 GiB, outside every memory cap)
_scratch_kept = 0  # bytes of scratch all sessions hold (`_count_scratch`)
_scratch_lock = threading.Lock()


_NO_SCRATCH = np.empty(0, np.uint8)
_NO_ROWS = _NO_SCRATCH.reshape(0, 0)


def _count_scratch(delta: int) -> None:
    global _scratch_kept
    with _scratch_lock:
        _scratch_kept += delta
SCRATCH_WINDOW = 16 << 20  # scratch a put's SSD / GPU blocks go through, written as it fills
MIN_PAYLOAD_RATE = 4 << 20  # bytes/s a put's payload must keep up (see _bound_payload)
MAX_OPEN_RESERVATIONS = 64  # per connection (a client has one open at a time, or a few)
MAX_RESERVED_HASHES = 1 << 17  # blocks reserved at once per connection (two full RESERVEs)
MAX_OPEN_LEASES = 1024  # per connection: past it a GET answers inline, leasing nothing (a
# client releases each lease with its next request: a few are open at a time)


REPLY_FRAMES: dict[tuple[w.Op, bytes, int], bytes] = {}  # see _reply_frame
MAX_REPLY_FRAMES = 4096


def _reply_frame(op: w.Op, key: bytes, payload_bytes: int, make) -> bytes:
    """The prefix and header of a reply that depends only on `key` (a put's statuses, a
    GET's tiers) and its payload length: encoded once and kept (a few thousand at most,
    keys of 16 blocks or fewer), since most requests get one of a few such replies (a
    message built, checked and encoded cost ~4 us a request)."""
    frame = REPLY_FRAMES.get((op, key, payload_bytes))
    if frame is None:
        frame = w.encode(make(), op, True, payload_bytes)
        if len(key) <= 16 and len(REPLY_FRAMES) < MAX_REPLY_FRAMES:
            REPLY_FRAMES[op, key, payload_bytes] = frame
    return frame


class StreamAborted(ConnectionError):
    """A reply that cannot be finished as promised: the connection is closed."""


TIER_CODES = {None: w.MISS, **{t: int(t) for t in TierKind}}  # a reply's byte per block
_DRAM_CODE = bytes((TIER_CODES[TierKind.DRAM],))


def _unread(sock: socket.socket) -> int:
    """Bytes sent on `sock` that its peer has not read yet (SIOCOUTQ; 0 where unknown)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        return 0


def tier_bytes(tiers: Sequence[TierKind | None]) -> bytes:
    """The tiers byte string of a GET or MATCH reply (a generator here was ~15 us of a 1 MiB
    GET's Python, its lines run with cold caches: see Session.get)."""
    return bytes(map(TIER_CODES.__getitem__, tiers))


class Session:
    def __init__(self, sock: socket.socket, reader: w.FrameReader, registry: Registry,
                 cfg: DaemonConfig, instance: bytes, local_name: str, local: bool,
                 tally: OpTally, drainer: Drainer | None = None) -> None:
        self.sock, self.reader, self.registry, self.cfg = sock, reader, registry, cfg
        self.instance, self.local_name, self.local = instance, local_name, local
        self.drainer, self.tally = drainer, tally  # (payload bytes counted in the tally)
        self.channel: PutChannel | None = None
        self.hosted: Hosted | None = None
        # open on this connection: id -> (reservation, when the store reclaims it)
        self.reservations: dict[int, tuple[Reservation, float]] = {}
        self.leases: set[int] = set()
        self._scratch = _NO_SCRATCH
        self._scratch_bytes = 0  # its size: trim_scratch runs after every request, and a
        # torch call there cost ~5 us once a megabyte's copy had evicted torch from cache
        self._rows = _NO_ROWS
        # (store, its DRAM rows, the same bytes as one flat memoryview)
        self._arena: tuple[object, np.ndarray | None, memoryview | None] = (None, None, None)
        self.staging: ShmSegment | None = None
        self._staged_bytes = 0  # all its STAGEs together (MAX_STAGED_BYTES)
        self._fd_replies = 0  # replies with descriptors sent (MAX_DESCRIPTOR_REPLIES)
        self.agent_key = b""
        self._rcvtimeo: bytes | None = None  # the socket's receive timeout, once read
        self._rcvtimeo_s = 0.0  # the same in seconds (0: none)
        # the config's figures a request reads, worked out once (each a property or an
        # attribute chain run cold after the last megabyte's copy): the connection's socket
        # timeout, and the slack a payload or a reply has past its bytes at MIN_PAYLOAD_RATE
        self._send_period = cfg.timeout_periods[0]
        self._reply_slack_s = 2 * cfg.reservation_timeout_s

    # ------------------------------------------------------------ plumbing

    def scratch(self, want: int, least: int | None = None, unit: int = 1) -> np.ndarray:
        """`want` bytes of scratch (this connection's, kept between requests: see
        trim_scratch). With `least`: fewer where all connections' scratch together would
        pass --scratch-memory, in whole `unit`s, `least` at any rate (every connection moves
        a block or two). Decided and counted in one step under the lock, so connections
        asking at once cannot each find the whole budget free. 24 connections that each
        asked for 32 MiB of SSD blocks and never read the reply held 32 MiB apiece until
        their deadlines (over a minute, renewed by asking again): the connections one tenant
        may open could hold tens of GiB, outside every memory limit."""
        global _scratch_kept
        with _scratch_lock:
            if least is not None:
                room = self.cfg.scratch_bytes - (_scratch_kept - self._scratch_bytes)
                want = max(least, min(want, room // unit * unit))
            grow = self._scratch_bytes < want
            if grow:
                _scratch_kept += want - self._scratch_bytes
        if grow:
            self._scratch, self._rows = _NO_SCRATCH, _NO_ROWS
            try:
                # in a mapping of its own, so that letting it go gives it back to the OS:
                # from the heap it stayed there (glibc keeps what a thread's arena freed, and
                # the daemon raises its trim threshold: tune_malloc_for_large_blocks)
                self._scratch = np.frombuffer(mmap.mmap(-1, want), np.uint8)
            except BaseException:
                _count_scratch(-want)
                self._scratch_bytes = 0
                raise
            self._scratch_bytes = want
        return self._scratch[:want]

    def trim_scratch(self) -> None:
        """After each request: scratch a big batch took (a put's or a GET's SSD / GPU blocks)
        is let go rather than kept for the connection's idle life, and so is any once all
        connections keep more than SCRATCH_KEEP_TOTAL (both within --scratch-memory: kept,
        it would hold other connections' windows to their least)."""
        n, budget = self._scratch_bytes, self.cfg.scratch_bytes
        if n and (n > min(SCRATCH_KEEP, budget // 8)
                  or _scratch_kept > min(SCRATCH_KEEP_TOTAL, budget // 4)):
            self._drop_scratch()

    def _drop_scratch(self) -> None:
        if self._scratch_bytes:
            _count_scratch(-self._scratch_bytes)
            self._scratch, self._scratch_bytes = _NO_SCRATCH, 0
            self._rows = _NO_ROWS

    def window_rows(self, n: int, least: int, block_bytes: int) -> np.ndarray:
        """`[n, block_bytes]` of scratch for a request's window: fewer rows to stay within
        --scratch-memory, `least` at any rate (see `scratch`). The view is kept for the next
        request of the same shape."""
        if self._rows.shape == (n, block_bytes):  # (held already: the common case, a GET
            return self._rows  # of one block that missed, with no lock or view op)
        flat = self.scratch(n * block_bytes, least * block_bytes, block_bytes)
        self._rows = flat.reshape(flat.size // block_bytes, block_bytes)
        return self._rows

    def recv_into(self, buf: np.ndarray) -> None:
        view = memoryview(buf)
        self.reader.recv_into(view)
        self.tally.bytes_in += view.nbytes

    def drain(self, nbytes: int) -> None:
        """Read and drop a payload we refuse, so the connection stays in step: by the
        deadline a payload we keep has (`_bound_payload`), else the connection closes. A
        COMMIT of the wrong size, its reservation kept, drained with no deadline: a client
        trickling a byte per period held the reservation (its blocks answered EXISTS to
        every other client, yet missed) and this thread for as long as it liked."""
        if not nbytes:
            return
        chunk = self.scratch(min(nbytes, 4 << 20), min(nbytes, 64 << 10))
        bound = None
        try:
            bound = self._bound_payload(nbytes)
            while nbytes:
                k = min(nbytes, chunk.size)
                self.recv_into(chunk[:k])
                nbytes -= k
        finally:
            self._unbound_payload(bound)

    def reply(self, op: w.Op, msg: w.Message, payload=()) -> None:
        w.send_frame(self.sock, msg, op, True, payload)
        if payload:
            self.tally.bytes_out += sum(memoryview(p).nbytes for p in payload)

    @property
    def store(self):
        if self.hosted is None:
            raise w.ProtocolError("send HELLO (token and namespace) before any other op")
        return self.hosted.store

    def dram_rows(self) -> np.ndarray | None:
        """The DRAM arena as a `[num_slots, block_bytes]` numpy view (indexing a row costs
        ~0.2 us, a torch row and its .numpy() ~4 us), None without a DRAM tier; looked up
        once per store."""
        if self.hosted is None:
            return None
        store = self.store
        if self._arena[0] is not store:
            rows = (store.tier(TierKind.DRAM).arena if TierKind.DRAM in store.tier_kinds
                    else None)
            self._arena = (store, rows, None if rows is None else memoryview(rows).cast("B"))
        return self._arena[1]

    # ------------------------------------------------------------ ops

    def hello(self, msg: w.Hello, payload_bytes: int) -> None:
        grant = self.cfg.tenant_of(msg.token)
        if grant is None:
            raise w.RemoteError(w.ErrorCode.AUTH, "bad or missing token (pass token= to the "
                                "client; the daemon reads its tokens from --token-file)")
        hosted = self.registry.open(namespace_of(msg), grant)
        self.close_ops()
        self._close_channel()
        self._drop_agent_key()
        self.hosted = hosted
        agent = hosted.agent if msg.agent else None
        if agent is not None:
            self.agent_key = hosted.agent_key(msg.agent_key)
        dram = hosted.dram
        self.reply(w.Op.HELLO, w.HelloOk(
            node_id=self.cfg.node_id, block_bytes=hosted.block_bytes,
            max_payload_bytes=self.cfg.max_payload_bytes, instance=self.instance,
            local_socket=self.local_name, arena_id=dram.arena_id if dram else b"",
            shm_slots=dram.num_slots if dram else 0,
            agent_meta=agent.metadata if agent else b"",
            agent_region=agent.region_id if agent else -1, agent_key=self.agent_key,
            lease_ttl_s=self.cfg.lease_ttl_s))

    def _same_host(self, op: str) -> None:
        if not self.local:
            raise w.RemoteError(w.ErrorCode.PROTOCOL, f"{op} is only served on the daemon's "
                                "local socket (same-host clients)")

    def _may_send_fds(self, op: str) -> None:
        """A request answered with descriptors (SHARE, STAGE, PUTS, each on the local socket
        only): MAX_DESCRIPTOR_REPLIES per connection, and only once the client has read
        every reply before it. The kernel counts descriptors in replies not read yet against the
        daemon's uid, up to its open-file limit, past which it passes none to anyone: one
        tenant asking for them and never reading made every other tenant's SHARE fail."""
        if self._fd_replies >= MAX_DESCRIPTOR_REPLIES:
            raise w.RemoteError(w.ErrorCode.QUOTA, f"this connection has had "
                                f"{MAX_DESCRIPTOR_REPLIES} replies with descriptors (SHARE, "
                                "STAGE, PUTS), the most one may: a client needs a few")
        if _unread(self.sock):
            raise w.RemoteError(w.ErrorCode.QUOTA, f"{op} while replies sent before it are "
                                "not read yet: read each reply before the next request")
        self._fd_replies += 1

    def _send_fds(self, msg: w.Message, op: w.Op, fds: list[int]) -> None:
        try:
            w.send_frame_fds(self.sock, msg, op, fds)
        except OSError as e:
            if e.errno != errno.ETOOMANYREFS:
                raise
            raise w.RemoteError(w.ErrorCode.UNAVAILABLE, "the daemon cannot pass descriptors "
                                "now (too many in flight, ETOOMANYREFS): blocks go inline "
                                "over the local socket; raise the daemon's open-file limit"
                                ) from e

    def share(self, msg: w.Share, payload_bytes: int) -> None:
        self._same_host("SHARE")
        dram = self.hosted.dram
        if dram is None:
            raise w.RemoteError(w.ErrorCode.NAMESPACE, "this namespace has no DRAM tier")
        self._may_send_fds("SHARE")
        fds = dram.share_fds()
        try:
            self._send_fds(w.ShareOk(arena_id=dram.arena_id, num_slots=dram.num_slots),
                           w.Op.SHARE, fds)
        finally:
            w.close_fds(fds)

    def check_payload(self, n: int, payload_bytes: int) -> None:
        bb = self.hosted.block_bytes
        if payload_bytes != n * bb:
            self.drain(payload_bytes)
            raise w.RemoteError(w.ErrorCode.BLOCK_SIZE, f"{payload_bytes} payload bytes for "
                                f"{n} blocks; blocks of namespace {self.hosted.ns.model!r} "
                                f"are {bb} bytes")

    def put(self, msg: w.Put, payload_bytes: int) -> None:
        store, hashes = self.hosted.store, msg.hash_list  # (authenticated: _serve checked)
        if msg.staged:
            return self._put_staged(hashes, payload_bytes)
        self.check_payload(len(hashes), payload_bytes)
        # no timeout: the reservation lives exactly as long as this request (reclaimed
        # midway, its slots went to other blocks while its bytes still arrived); the
        # payload's deadline bounds the request, and the abort below ends it
        res = store.reserve_n(hashes, timeout_s=math.inf)
        bound = None
        try:
            bound = self._bound_payload(payload_bytes)
            self._recv_blocks(res, range(len(hashes)))
        except TierIOError as e:  # the payload was read in full: the connection stays in step
            return self._put_reply(store.abort_failed(res, e))
        except BaseException:
            store.abort(res.reservation_id)
            raise
        finally:
            self._unbound_payload(bound)
        store.commit(res.reservation_id)
        self._put_reply(res.statuses)

    def _put_reply(self, statuses) -> None:
        codes = bytes(map(STATUS_CODES.__getitem__, statuses))
        self.sock.sendall(_reply_frame(w.Op.PUT, codes, 0, lambda: w.PutOk(statuses=codes)))

    def puts(self, msg: w.Puts, payload_bytes: int) -> None:
        """Make this connection a put channel (kvstore.daemon.putchannel)."""
        self._same_host("PUTS")
        if self.hosted.dram is None or self.drainer is None:
            raise w.RemoteError(w.ErrorCode.NAMESPACE, "no DRAM tier: puts need a request")
        if self.channel is not None:
            raise w.RemoteError(w.ErrorCode.PROTOCOL, "this connection is a put channel already")
        self._may_send_fds("PUTS")
        self.channel = PutChannel(self.hosted)
        self.drainer.add(self.channel)
        # A put channel is silent by design: no idle timeout (its grants must outlive
        # quiet spells); it ends when the client closes it or dies (the kernel closes it).
        self._rcvtimeo, self._rcvtimeo_s = struct.pack("ll", 0, 0), 0.0
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._rcvtimeo)
        fds = self.channel.fds()
        try:
            self._send_fds(w.PutsOk(
                arena_id=self.hosted.dram.arena_id, capacity=self.channel.ring.capacity,
                grant_capacity=self.channel.ring.grant_capacity), w.Op.PUTS, fds)
        finally:
            w.close_fds(fds)

    def flush(self, msg: w.Flush, payload_bytes: int) -> None:
        if msg.want < 0:
            raise w.ProtocolError(f"FLUSH want is {msg.want}: a number of slots, 0 or more")
        n = self.channel.drain(msg.want) if self.channel is not None else 0
        self.reply(w.Op.FLUSH, w.Ack(value=n))

    def _close_channel(self, store: bool = True, give_back: bool = True) -> None:
        if self.channel is not None:
            channel, self.channel = self.channel, None
            try:
                if self.drainer is not None:
                    self.drainer.remove(channel)
                channel.close(store, give_back)
            finally:  # no longer a (silent) put channel: the idle timeout is back (a
                # re-HELLO after PUTS left the connection with none, for good)
                self._rcvtimeo, self._rcvtimeo_s = None, 0.0
                try:
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                         w.timeval(self._send_period))
                except OSError:
                    pass  # (the connection is closing)

    def stage(self, msg: w.Stage, payload_bytes: int) -> None:
        """A staging segment for this connection's puts, bigger than the one it has (the
        client keeps mapping the old one for as long as it likes: a connection asking again
        and again held 1 GiB of shared memory for 16 STAGEs of 64 MiB). Its pages are left
        for the client to touch (so they are the client's memory), and all of one
        connection's STAGEs together are MAX_STAGED_BYTES at most."""
        self._same_host("STAGE")
        if not 0 < msg.nbytes <= MAX_STAGE_BYTES:
            raise w.RemoteError(w.ErrorCode.PROTOCOL, f"a staging segment is 1 to "
                                f"{MAX_STAGE_BYTES} bytes, not {msg.nbytes}")
        have = self.staging.size if self.staging is not None else 0
        if msg.nbytes <= have or self._staged_bytes + msg.nbytes > MAX_STAGED_BYTES:
            raise w.RemoteError(w.ErrorCode.QUOTA, f"a STAGE of {msg.nbytes} bytes: this "
                                f"connection's segment has {have} (a STAGE asks for more), "
                                f"and its STAGEs came to {self._staged_bytes} of the "
                                f"{MAX_STAGED_BYTES} one connection may have")
        self._may_send_fds("STAGE")
        self._close_staging()
        self._staged_bytes += msg.nbytes
        self.staging = ShmSegment.anonymous(msg.nbytes, "kvtier-stage", prefault=False)
        fd = self.staging.share_fd(writable=True)
        try:
            self._send_fds(w.StageOk(nbytes=msg.nbytes), w.Op.STAGE, [fd])
        finally:
            os.close(fd)

    def _put_staged(self, hashes: list[bytes], payload_bytes: int) -> None:
        """Blocks the client copied into our staging segment: reserve, copy, commit."""
        bb, n = self.hosted.block_bytes, len(hashes)
        if payload_bytes:
            self.drain(payload_bytes)
            raise w.RemoteError(w.ErrorCode.PROTOCOL, "a staged PUT carries no payload")
        if self.staging is None or n * bb > self.staging.size:
            raise w.RemoteError(w.ErrorCode.PROTOCOL, f"a staged PUT of {n} blocks needs a "
                                f"staging segment of {n * bb} bytes (send STAGE first)")
        rows = self.staging.array[:n * bb].reshape(n, bb)
        store = self.store
        res = store.reserve_n(hashes, timeout_s=math.inf)  # filled here and now (see put)
        try:
            store.write_reserved(res, rows)
        except TierIOError as e:
            return self._put_reply(store.abort_failed(res, e))
        except BaseException:
            store.abort(res.reservation_id)
            raise
        store.commit(res.reservation_id)
        self.tally.bytes_in += n * bb
        self._put_reply(res.statuses)

    def _bound_payload(self, payload_bytes: int) -> bytes | None:
        """A payload that holds reserved slots must come at MIN_PAYLOAD_RATE at least,
        after twice --reservation-timeout of grace: else a client trickling a byte per idle
        timeout held up to 1 GiB of slots for as long as it liked. Past the deadline the
        put is aborted (nothing stored) and the connection closed. The deadline is checked
        between reads, each bounded by the socket's receive timeout (a read that times out
        before the deadline is tried again): the connection's own, at most twice the
        reservation timeout once authenticated (DaemonConfig.timeout_periods), so a put
        sets none. Returns what `_unbound_payload` restores (None: nothing was changed).
        The connection's receive timeout is read once and kept (this session is the only
        one to change it later: `puts`)."""
        if not payload_bytes:
            return None
        allowed = self._reply_slack_s + payload_bytes / MIN_PAYLOAD_RATE
        self.reader.payload_deadline = time.monotonic() + allowed
        before = self._rcvtimeo
        if before is None:
            before = self._rcvtimeo = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
            sec, usec = struct.unpack("ll", before)
            self._rcvtimeo_s = sec + usec / 1e6
        if 0 < self._rcvtimeo_s <= allowed:
            return b""  # the connection's timeout bounds each read more tightly already
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, w.timeval(allowed))
        return before

    def _unbound_payload(self, before: bytes | None) -> None:
        if before is None:
            return
        self.reader.payload_deadline = None
        if before:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, before)

    def _recv_blocks(self, res: Reservation, indices: Sequence[int]) -> None:
        """Receive blocks `indices` of a reservation: DRAM slots in place, the rest through
        scratch of at most SCRATCH_WINDOW bytes, written to their tier window by window
        (scratch for the whole batch, up to 1 GiB, stayed resident for as long as a client
        took to send it: a few stalled puts ran a host out of memory); blocks not STORED are
        read and dropped. A tier's write error is raised once the whole payload is read, so
        the connection stays in step."""
        bb = self.hosted.block_bytes
        arena = self.dram_rows()
        slots = res.slots
        if len(indices) == 1 and slots[indices[0]] is not None \
                and slots[indices[0]][0] is TierKind.DRAM:  # one block, straight into its slot
            at = slots[indices[0]][1] * bb
            self.reader.recv_into(self._arena[2][at:at + bb])
            self.tally.bytes_in += bb
            return
        inline = sum(1 for i in indices if slots[i] is None or slots[i][0] is not TierKind.DRAM)
        scratch = (self.window_rows(min(inline, max(1, SCRATCH_WINDOW // bb)), 1, bb)
                   if inline else None)
        waiting: dict[TierKind, list[tuple[int, int]]] = {}  # tier -> (scratch row, block)
        used, failed = 0, None
        for i in indices:
            slot = res.slots[i]
            if slot is not None and slot[0] is TierKind.DRAM:
                self.recv_into(arena[slot[1]])
                continue
            self.recv_into(scratch[used])
            if slot is not None and failed is None:
                waiting.setdefault(slot[0], []).append((used, i))
            used += 1
            if used == len(scratch):
                failed = failed or self._write_window(res, scratch, waiting)
                used = 0
        failed = failed or self._write_window(res, scratch, waiting)
        if failed is not None:
            raise failed

    def _write_window(self, res: Reservation, scratch, waiting) -> TierIOError | None:
        """Write the blocks waiting in scratch to their tiers; the error, if one failed."""
        try:
            for kind, rows in waiting.items():
                self.store.tier(kind).write_n([res.slots[i][1] for _, i in rows],
                                              [res.hashes[i] for _, i in rows],
                                              [scratch[k] for k, _ in rows])
        except TierIOError as e:
            return e
        finally:
            waiting.clear()
        return None

    def get(self, msg: w.Get, payload_bytes: int) -> None:
        """One store visit per hash: DRAM blocks are leased, the rest copied (and
        promoted). A client that maps the arena (`shm`) gets the leased slots and only the
        other blocks inline; any other client gets every block inline, a batch found all
        in DRAM sent straight from its slots, held (no lease) until the reply is out."""
        store, hashes = self.store, msg.hash_list
        if msg.release:
            self.release_n(msg.release)
        shm = msg.shm and self._may_lease()
        bb, arena = self.hosted.block_bytes, self.dram_rows()
        if len(hashes) * bb > self.cfg.max_payload_bytes:  # the reply, and the scratch it
            raise w.RemoteError(w.ErrorCode.TOO_LARGE,  # may take: bounded like a put's
                                f"a GET of {len(hashes)} blocks of {bb} bytes could answer "
                                f"{len(hashes) * bb} bytes; a reply carries at most "
                                f"{self.cfg.max_payload_bytes}: split the batch")
        if not shm and arena is not None:  # a DRAM-resident batch streams from its slots,
            held = store.hold_n(hashes, TierKind.DRAM, msg.prefix)  # held while it goes out
            if held is not None:
                kinds, entries = held
                self.hosted.count_lease_hits(len(entries))
                nbytes = len(entries) * bb
                # (all hits, the common case: one byte repeated, not a lookup per block)
                tiers = _DRAM_CODE * len(kinds) if len(entries) == len(kinds) else tier_bytes(kinds)
                # (every line here runs with cold caches, the megabyte the last request
                # moved having evicted them: a generator unpacked into the views was ~15 us
                # of a 1 MiB GET's ~170 us of Python, by py-spy)
                views = [memoryview(_reply_frame(w.Op.GET, tiers, nbytes,
                                                 lambda: w.GetOk(tiers=tiers)))]
                flat = self._arena[2]  # slices of one memoryview: a numpy row and its
                views += [flat[e.slot * bb:(e.slot + 1) * bb] for e in entries]  # view cost more
                try:  # (by a deadline however small: a reply that fits the socket's buffer
                    # still waits behind an earlier one its client has not read, and the
                    # 4 MiB the buffers held no longer after they went to 1 MiB let a client
                    # reading a little at a time hold the blocks for as long as it liked)
                    self._send_before(views, self._reply_deadline(nbytes))
                    self.tally.bytes_out += nbytes
                finally:
                    store.unhold_n(entries)
                return
        # a reader that copies DRAM slots itself, of a batch all in DRAM: leased in one
        # visit and answered with no payload (no scratch, no stream: ~40 us of Python less a
        # GET, by py-spy)
        lease = (store.lease_n(hashes, self.cfg.lease_ttl_s, msg.prefix)
                 if shm and arena is not None else None)
        scratch, k = None, 0
        if lease is None:
            # the blocks to copy go through two windows of scratch: the first window's
            # copied up front, the rest read part by part as the reply goes out (_stream).
            # A GET of 1 GiB of SSD blocks held 1 GiB of scratch for as long as its client
            # took to read it, and a few such clients ran the host out of memory.
            k = min(len(hashes), max(1, SCRATCH_WINDOW // bb))
            scratch = self.window_rows(2 * k, 2, bb)
            k = len(scratch) // 2
            # (no TTL while the reply goes out: a same-host client's starts once it is out)
            lease = store.fetch_n(hashes, scratch[:k], ttl_s=math.inf,
                                  lease_tier=TierKind.DRAM if arena is not None else None,
                                  prefix=msg.prefix, max_copied=k)
        tiers = tier_bytes([None if h is None else h[0] for h in lease.hits])
        slots = [w.NO_SLOT if h is None else h[1] for h in lease.hits]
        hits = [i for i, h in enumerate(lease.hits) if h is not None]
        self.hosted.count_lease_hits(sum(slots[i] >= 0 for i in hits))
        if shm:
            if lease.lease_id:
                self.leases.add(lease.lease_id)
            shown = np.maximum(np.array(slots, "<i8"), w.NO_SLOT)  # deferred: inline too
            reply = w.GetOk(tiers=tiers, lease_id=lease.lease_id, slots=shown.tobytes())
            if scratch is None:  # every hit leased (its TTL set already)
                return self.reply(w.Op.GET, reply)
            self._stream(reply, lease, hashes, [i for i in hits if slots[i] < 0], slots,
                         scratch, k, arena)
            store.renew_lease(lease.lease_id, self.cfg.lease_ttl_s)
            return
        try:
            self._stream(w.GetOk(tiers=tiers), lease, hashes, hits, slots, scratch, k, arena)
        finally:
            store.release(lease.lease_id)

    def _send_before(self, views: list[memoryview], deadline: float) -> None:
        """Send views whole by `deadline` (TimeoutError past it; see wire.send_views), then
        put the connection's send timeout back if the deadline took its place."""
        period = self._send_period
        changed = True
        try:
            changed = w.send_views(self.sock, views, deadline, period)
        finally:
            if changed:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, w.timeval(period))

    def _reply_deadline(self, nbytes: int) -> float:
        """By when a reply of `nbytes` must be out: as a put's payload must come in (see
        _bound_payload), so a client that reads a byte now and then cannot hold the blocks
        its reply pins, nor this thread, for as long as it likes."""
        return time.monotonic() + self._reply_slack_s + nbytes / MIN_PAYLOAD_RATE

    def _stream(self, msg: w.GetOk, lease, hashes: list[bytes], order: list[int],
                slots: list[int], scratch: np.ndarray, k: int,
                arena: np.ndarray | None) -> None:
        """Send a GET reply: `msg`, then the bytes of the blocks `order` names, in order:
        leased DRAM slots (a TCP client's) from the arena, copied blocks from the first k
        rows of `scratch` (`lease.rows` says which), and deferred ones
        (DEFERRED) read into its other k rows just before they go, a part at a time. Once
        the header is out nothing else can be said on the connection: a deferred block
        found corrupted, a slow or vanished client, any failure, closes it (StreamAborted;
        the client retries, and a block found corrupted, dropped, is a miss then)."""
        bb = self.hosted.block_bytes
        rows, window = scratch[:k], scratch[k:]
        nbytes = len(order) * bb
        deadline = self._reply_deadline(nbytes)
        header = memoryview(w.encode(msg, w.Op.GET, True, nbytes))
        bufs = [header]
        deferred: list[tuple[int, int]] = []  # (hash index, its place in bufs)
        try:
            for i in order:
                slot = slots[i]
                if slot == DEFERRED:
                    if len(deferred) == len(window):
                        self._send_part(lease.lease_id, hashes, bufs, deferred, window, deadline)
                        self.tally.bytes_out += (len(bufs) - (bufs[0] is header)) * bb
                        bufs, deferred = [], []
                    deferred.append((i, len(bufs)))
                    bufs.append(None)
                else:
                    bufs.append(memoryview(arena[slot] if slot >= 0 else rows[lease.rows[i]]))
            self._send_part(lease.lease_id, hashes, bufs, deferred, window, deadline)
            self.tally.bytes_out += (len(bufs) - (bufs[0] is header)) * bb
        except StreamAborted:
            raise
        except Exception as e:  # mid-reply: an error frame would be read as block bytes
            raise StreamAborted(f"a GET reply could not be finished: {e}") from e

    def _send_part(self, lease_id: int, hashes: list[bytes], bufs: list,
                   deferred: list[tuple[int, int]], window: np.ndarray,
                   deadline: float) -> None:
        """Read the deferred blocks of one part of a GET reply into the window, then send
        the part."""
        if deferred:
            ok = self.store.read_deferred(lease_id, [hashes[i] for i, _ in deferred],
                                          window[:len(deferred)])
            if not all(ok):
                log.warning("a GET's block was found corrupted after its reply had promised "
                            "it: connection closed (the client retries; it is a miss now)")
                raise StreamAborted("a block of the reply was found corrupted")
            for j, (_, at) in enumerate(deferred):
                bufs[at] = memoryview(window[j])
        self._send_before([b.cast("B") for b in bufs], deadline)

    def reserve(self, msg: w.Reserve, payload_bytes: int) -> None:
        hashes = msg.hash_list
        self._make_room_for_reservation(len(hashes))
        # a same-host client writes its DRAM slots itself, and so does one holding a key to
        # the namespace's transfer agent (one-sided writes from another host): if the
        # reservation times out, they stay out of use until it sends COMMIT / ABORT for it,
        # or goes (a plain TCP client writes none: its slots go back at once). An agent
        # writer's had gone back at once: a write stalled past the timeout landed in a slot
        # another block had been committed to, served to every reader of that block.
        writes_slots = self.local or bool(self.agent_key)
        res = self.store.reserve_n(hashes, timeout_s=self.cfg.reservation_timeout_s,
                                   owner=self if writes_slots else None)
        self.reservations[res.reservation_id] = (res, time.monotonic()
                                                 + self.cfg.reservation_timeout_s)
        slots = [s[1] if s is not None and s[0] is TierKind.DRAM else w.NO_SLOT for s in res.slots]
        self.reply(w.Op.RESERVE, w.ReserveOk(
            reservation_id=res.reservation_id,
            statuses=bytes(STATUS_CODES[s] for s in res.statuses),
            slots=np.array(slots, "<i8").tobytes()))

    def _make_room_for_reservation(self, num_hashes: int) -> None:
        """Forget the reservations the store has reclaimed (their timeout passed); refuse a
        new one past MAX_OPEN_RESERVATIONS or MAX_RESERVED_HASHES on this connection (each
        open one is memory the daemon keeps for the connection until commit or abort)."""
        now = time.monotonic()
        for rid in [r for r, (_, until) in self.reservations.items() if until <= now]:
            del self.reservations[rid]
        kept, kept_blocks = self.store.num_quarantined(self)  # timed out, still its slots
        opened = len(self.reservations) + kept
        held = sum(len(r.hashes) for r, _ in self.reservations.values()) + kept_blocks
        if opened >= MAX_OPEN_RESERVATIONS or held + num_hashes > MAX_RESERVED_HASHES:
            raise w.RemoteError(w.ErrorCode.QUOTA, f"this connection has {opened} "
                                f"reservations open ({held} blocks): commit or abort them first "
                                f"(at most {MAX_OPEN_RESERVATIONS}, {MAX_RESERVED_HASHES} blocks)")

    def _forget_reservation(self, rid: int) -> Reservation | None:
        return self.reservations.pop(rid, (None, 0.0))[0]

    def commit(self, msg: w.Commit, payload_bytes: int) -> None:
        res = self._forget_reservation(msg.reservation_id)
        if res is None:
            self.drain(payload_bytes)
            self._release_timed_out(msg.reservation_id)
            raise w.RemoteError(w.ErrorCode.RESERVATION, f"reservation {msg.reservation_id} "
                                "is not open on this connection")
        inline = [i for i, s in enumerate(res.slots) if s is not None and s[0] is not TierKind.DRAM]
        try:
            try:  # no timeout from here on: its inline blocks are being received
                self.store.keep_reservation(res.reservation_id)
            except ReservationError:
                self.drain(payload_bytes)
                raise
            self.check_payload(len(inline), payload_bytes)
            bound = None
            try:
                bound = self._bound_payload(payload_bytes)
                self._recv_blocks(res, inline)
            finally:
                self._unbound_payload(bound)
            self.store.commit(res.reservation_id)
        except ReservationError as e:  # reclaimed after its timeout: nothing stored
            self._release_timed_out(res.reservation_id)
            raise w.RemoteError(w.ErrorCode.RESERVATION, f"{e}; nothing was stored (commit "
                                "within --reservation-timeout)") from e
        except TierIOError as e:
            self.store.abort_failed(res, e)
            raise w.RemoteError(w.ErrorCode.NO_SPACE, f"nothing stored: {e}") from e
        except BaseException:
            self._abort(res.reservation_id)
            raise
        self.reply(w.Op.COMMIT, w.Ack(value=len(res.hashes)))

    def abort(self, msg: w.Abort, payload_bytes: int) -> None:
        if self._forget_reservation(msg.reservation_id) is not None:
            self._abort(msg.reservation_id)
        else:
            self._release_timed_out(msg.reservation_id)
        self.reply(w.Op.ABORT, w.Ack())

    def _abort(self, rid: int) -> None:
        try:
            self.store.abort(rid)
        except ReservationError:  # reclaimed after its timeout: its DRAM slots waited for
            self._release_timed_out(rid)  # this word from the client

    def _release_timed_out(self, rid: int) -> None:
        """The client is done with a reservation the store reclaimed after its timeout
        (it sent COMMIT or ABORT for it): its DRAM slots may be reused now."""
        if self.hosted is not None:
            try:
                self.store.release_owned(self, rid)
            except StoreClosedError:
                pass

    def exists(self, msg: w.Exists, payload_bytes: int) -> None:
        self.reply(w.Op.EXISTS, w.Ack(flags=bytes(self.store.contains_n(msg.hash_list))))

    def match(self, msg: w.Match, payload_bytes: int) -> None:
        m = self.store.match_prefix(msg.hash_list)
        self.reply(w.Op.MATCH, w.MatchOk(num_blocks=m.num_blocks, tiers=tier_bytes(m.tiers)))

    def remove(self, msg: w.Remove, payload_bytes: int) -> None:
        self.reply(w.Op.REMOVE, w.Ack(value=self.store.remove_n(msg.hash_list)))

    def pin(self, msg: w.Pin, payload_bytes: int) -> None:
        self.reply(w.Op.PIN, w.Ack(flags=bytes(self.store.pin_n(msg.hash_list, msg.ttl_s))))

    def unpin(self, msg: w.Unpin, payload_bytes: int) -> None:
        self.store.unpin_n(msg.hash_list)
        self.reply(w.Op.UNPIN, w.Ack())

    def release(self, msg: w.Release, payload_bytes: int) -> None:
        self.release_n(msg.lease_ids)
        self.reply(w.Op.RELEASE, w.Ack())

    def _may_lease(self) -> bool:
        """Whether this connection may open another lease: fewer than MAX_OPEN_LEASES open
        (the ids of leases the store ended at their TTL are let go first). A client that
        never released piled up ids for the connection's life (~150 MiB of them after 400k
        GETs), and the store's leases, each holding blocks, for their TTL."""
        if len(self.leases) < MAX_OPEN_LEASES:
            return True
        self.leases = self.store.open_leases(self.leases)
        return len(self.leases) < MAX_OPEN_LEASES

    def release_n(self, lease_ids: Sequence[int]) -> None:
        for lid in lease_ids:
            if lid in self.leases:  # only this connection's own leases
                self.leases.discard(lid)
                self.store.release(lid)

    def touch(self, msg: w.Touch, payload_bytes: int) -> None:
        hashes, reads = msg.hash_list, None
        if msg.reads:
            if len(msg.reads) != 4 * len(hashes):
                raise w.ProtocolError(f"TOUCH has {len(hashes)} hashes but {len(msg.reads)} "
                                      "bytes of read counts (4 per hash)")
            reads = np.minimum(np.frombuffer(msg.reads, "<u4"), w.TOUCH_MAX_READS).tolist()
        n = self.store.touch_n(hashes, reads)
        self.hosted.count_direct_hits(n)
        self.reply(w.Op.TOUCH, w.Ack(value=n))

    def stats(self, msg: w.Stats, payload_bytes: int) -> None:
        s = self.store.stats()
        rows = tuple((int(t.kind), t.capacity_blocks, t.used_blocks, t.free_blocks,
                      *vars(t.counters).values()) for t in s.tiers)
        self.reply(w.Op.STATS, w.StatsOk(misses=s.misses, open_reservations=s.open_reservations,
                                         open_leases=s.open_leases, tiers=rows,
                                         write_errors=s.write_errors,
                                         background_errors=s.background_errors))

    def close(self) -> None:
        """The connection ended: its scratch, staging segment and agent capability go too."""
        self._drop_scratch()
        self._close_staging()

    def _close_staging(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None

    def _drop_agent_key(self) -> None:
        if self.agent_key and self.hosted is not None:
            self.hosted.drop_agent_key(self.agent_key)
        self.agent_key = b""

    def end(self, store: bool = True, stopping: bool = False) -> None:
        """Everything this connection held, given back (it closed). `store` False: its
        namespace is being cleared, and the store's close, running meanwhile, ends its
        reservations, leases and grants: only what the connection holds itself goes.
        `stopping`: the daemon ends the connection, its client maybe still putting through
        its put channel: the channel's grants are kept out of use (PutChannel.close)."""
        try:
            self._close_channel(store, give_back=not stopping)
        finally:
            try:
                # the transfer connections of its agent key (when it was the key's last
                # holder) end before its slots go back: a write of theirs still arriving
                # would land in slots handed to other blocks
                try:
                    self._drop_agent_key()
                finally:
                    if store:
                        self.close_ops()  # even if the channel's last drain failed
            finally:
                self.close()

    def close_ops(self) -> None:
        """The connection ended (or re-helloed): its reservations and leases end with it."""
        if self.hosted is None:
            return
        for rid in list(self.reservations):
            self._abort(rid)
        self.reservations.clear()
        try:
            self.store.end_owner(self)  # what its timed-out reservations kept out of use
        except StoreClosedError:
            pass
        self.release_n(list(self.leases))


HANDLERS = {w.Op.HELLO: Session.hello, w.Op.PUT: Session.put, w.Op.GET: Session.get,
            w.Op.RESERVE: Session.reserve, w.Op.COMMIT: Session.commit,
            w.Op.ABORT: Session.abort, w.Op.EXISTS: Session.exists, w.Op.MATCH: Session.match,
            w.Op.REMOVE: Session.remove, w.Op.PIN: Session.pin, w.Op.UNPIN: Session.unpin,
            w.Op.RELEASE: Session.release, w.Op.STATS: Session.stats, w.Op.TOUCH: Session.touch,
            w.Op.STAGE: Session.stage, w.Op.SHARE: Session.share, w.Op.PUTS: Session.puts,
            w.Op.FLUSH: Session.flush}
