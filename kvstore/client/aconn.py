"""One data-plane connection of the asyncio SDK: the frames of `conn.Connection`, read and
written on the event loop itself (a non-blocking socket and the loop's sock_* calls; no
thread). Payload bytes are received straight into the caller's buffer (sock_recv_into)
and sent gathered from the caller's buffers (sendmsg), as the blocking connection does.

A connection is used by one coroutine at a time (the client's pool hands it out); a
coroutine cancelled mid-frame leaves it in an unknown state, so the pool closes it."""
from __future__ import annotations

import asyncio
import ipaddress
import socket

import numpy as np

from kvstore import wire as w
from kvstore.client import replies
from kvstore.client.conn import Address, LocalAddress
from kvstore.client.errors import ConnectError, RequestTimeout
from kvstore.keys import Namespace
from transfer.shm import ShmSegment
from transfer.sockio import Spin

CHUNK = w.FrameBuffer.CHUNK  # one recv for a frame's prefix and header in the common case


async def _resolve(loop, addr: Address) -> tuple[int, tuple]:
    """(family, sockaddr) of a daemon address: an IP literal as it is, a host name through
    the loop's resolver (which runs getaddrinfo on the loop's default thread pool)."""
    try:
        ip = ipaddress.ip_address(addr.host)
    except ValueError:
        infos = await loop.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
        return infos[0][0], infos[0][4]
    return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), (addr.host, addr.port)


class AsyncConnection:
    def __init__(self, sock: socket.socket, addr: Address | LocalAddress,
                 timeout_s: float) -> None:
        self.sock, self.addr, self.timeout_s = sock, addr, timeout_s
        self.local = isinstance(addr, LocalAddress)
        self.loop = asyncio.get_running_loop()
        self.pending_release: list[int] = []
        self.info: w.HelloOk | None = None
        self.buffered = w.FrameBuffer()  # bytes read past the last header (a payload's start)
        self._staging: ShmSegment | None = None
        self.spin: Spin | None = None  # set by the client while this is its only call (_take)

    @classmethod
    async def open(cls, addr: Address | LocalAddress, token: str, ns: Namespace,
                   timeout_s: float, connect_timeout_s: float) -> AsyncConnection:
        """Connect and say HELLO; ConnectError when nothing answers at `addr`."""
        family = socket.AF_UNIX if isinstance(addr, LocalAddress) else socket.AF_INET
        target = "\0" + addr.name if family == socket.AF_UNIX else None
        loop = asyncio.get_running_loop()
        try:
            if target is None:
                family, target = await _resolve(loop, addr)
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            raise ConnectError(f"cannot reach the kvtier daemon at {addr} ({e}); "
                               "is `kvtier serve` running there?") from e
        sock.setblocking(False)
        try:
            async with asyncio.timeout(connect_timeout_s):
                await loop.sock_connect(sock, target)
        except (OSError, TimeoutError) as e:
            sock.close()
            raise ConnectError(f"cannot reach the kvtier daemon at {addr} ({e or 'timed out'}"
                               "); is `kvtier serve` running there?") from e
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        w.size_buffers(sock)
        conn = cls(sock, addr, timeout_s)
        try:
            conn.info = (await conn.call(replies.hello(ns, token)))[0]
        except BaseException:
            conn.close()
            raise
        return conn

    # ------------------------------------------------------------ requests

    async def call(self, msg: w.Message, payload=()) -> tuple[w.Message, int]:
        """Send a request, read its reply's header (its payload, if any, comes next)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._send(msg, payload)
                frame = await self._frame()
        except TimeoutError as e:
            raise RequestTimeout(f"no reply to {msg.OP.name} from {self.addr} within "
                                 f"{self.timeout_s}s (raise timeout_s for big batches)") from e
        return replies.check_reply(frame, msg.OP)

    async def call_fds(self, msg: w.Message, num_fds: int) -> tuple[w.Message, list[int]]:
        """A request whose reply carries `num_fds` descriptors (local socket only); the
        caller owns them."""
        if self.buffered.pending():
            raise w.ProtocolError("descriptors expected at a frame boundary, bytes were pending")
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._send(msg, ())
                while True:
                    await self._ready(self.loop.add_reader, self.loop.remove_reader)
                    try:
                        data, fds, flags = w.recv_fds(self.sock, CHUNK, w.MAX_FDS)
                        break
                    except BlockingIOError:
                        continue
                try:
                    if not data:
                        raise ConnectionError("peer closed the connection")
                    if flags & socket.MSG_CTRUNC:
                        raise w.ProtocolError("more descriptors than a reply may carry")
                    self.buffered.load(data)
                    frame = await self._frame()
                except BaseException:
                    w.close_fds(fds)
                    raise
        except TimeoutError as e:
            raise RequestTimeout(f"no reply to {msg.OP.name} within {self.timeout_s}s") from e
        return replies.check_fds(frame, msg.OP, fds, num_fds), fds

    async def recv_into(self, view: memoryview) -> None:
        """Fill `view` with payload bytes: buffered ones first, then from the socket,
        RECV_CHUNK bytes a call at most (as `wire.recv_exact`: measured here, a 4 MiB get
        went 2.3-2.7 -> 3.6-4.0 GB/s and 16 x 1 MiB 2.2-2.7 -> 3.2-3.7 against receiving
        all that had arrived in each call)."""
        k = self.buffered.take_into(view)
        k += self._recv_ready(view[k:])
        if k == view.nbytes:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                while k < view.nbytes:
                    got = await self._recv_waiting(view[k:k + w.RECV_CHUNK])
                    if not got:
                        raise ConnectionError("peer closed the connection mid-frame")
                    k += got
                    k += self._recv_ready(view[k:])
        except TimeoutError as e:
            raise RequestTimeout(f"payload from {self.addr} stalled for "
                                 f"{self.timeout_s}s") from e

    async def flush_releases(self) -> None:
        if self.pending_release:
            ids, self.pending_release = tuple(self.pending_release), []
            await self.call(w.Release(lease_ids=ids))

    async def staging(self, nbytes: int) -> np.ndarray:
        """This connection's staging segment, at least nbytes long (see Connection)."""
        if self._staging is None or self._staging.size < nbytes:
            reply, (fd,) = await self.call_fds(w.Stage(nbytes=nbytes), 1)
            self._drop_staging()
            self._staging = ShmSegment.from_fd(fd, writable=True, size=reply.nbytes)
        return self._staging.array

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def close(self) -> None:
        self._drop_staging()
        self.sock.close()

    # ------------------------------------------------------------ frames

    async def _frame(self) -> w.Frame:
        op_code, reply, header_len, payload_len = w.decode_prefix(
            await self._take(w.PREFIX.size), 1 << 62)
        msg = w.decode_header(op_code, reply, w.unpadded(
            await self._take(header_len + w.header_pad(header_len, payload_len)), header_len))
        return w.Frame(w.Op(op_code), reply, msg, payload_len)

    async def _take(self, n: int) -> bytes:
        buf = self.buffered
        while buf.pending() < n:
            try:  # what has arrived, with no trip round the loop
                got = self.sock.recv_into(buf.room(n))
            except (BlockingIOError, InterruptedError):
                got = await self._recv_waiting(buf.room(n))
            if not got:
                raise ConnectionError("peer closed the connection mid-frame")
            buf.received(got)
        return buf.take(n)

    async def _recv_waiting(self, view) -> int:
        """Bytes received into `view` once some come (0: the peer closed): polled for first
        while this is the client's only call (`spin`: the loop has nothing else to run
        meanwhile), else, or after, awaited on the loop."""
        spin = self.spin
        got = spin.poll(self.sock, view) if spin is not None else None
        if got is None:
            got = await self.loop.sock_recv_into(self.sock, view)
            if spin is not None:
                spin.blocked()
        return got

    def _recv_ready(self, view: memoryview) -> int:
        """Receive into `view` what has arrived already, RECV_CHUNK bytes a call, with no
        trip round the event loop (uvloop's sock_recv_into always waits for the next
        readiness callback: a 256 KiB get took ~310 us on it against ~215 on asyncio's
        loop, ~160 with the blocking client); how many bytes. A closed peer is left for
        the awaited receive to find."""
        k, n = 0, view.nbytes
        while k < n:
            try:
                got = self.sock.recv_into(view[k:k + w.RECV_CHUNK])
            except (BlockingIOError, InterruptedError):
                return k
            if not got:
                return k
            k += got
        return k

    async def _send(self, msg: w.Message, payload) -> None:
        """One frame and its payload buffers, gathered by sendmsg (no join)."""
        views = [memoryview(b).cast("B") for b in payload]
        head = w.encode(msg, msg.OP, False, sum(v.nbytes for v in views))
        if not views:
            try:  # a request's header goes at once as a rule: no trip round the loop
                sent = self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent < len(head):
                await self.loop.sock_sendall(self.sock, memoryview(head)[sent:])
            return
        bufs = [memoryview(head), *views]
        while bufs:
            try:
                sent = self.sock.sendmsg(bufs[:256])
            except BlockingIOError:
                await self._ready(self.loop.add_writer, self.loop.remove_writer)
                continue
            while bufs and sent >= len(bufs[0]):
                sent -= len(bufs.pop(0))
            if sent:
                bufs[0] = bufs[0][sent:]

    async def _ready(self, add, remove) -> None:
        """Wait until the socket is readable (add_reader) or writable (add_writer)."""
        fd = self.sock.fileno()
        ready = self.loop.create_future()
        add(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            remove(fd)

    def _drop_staging(self) -> None:
        if self._staging is not None:
            self._staging, segment = None, self._staging
            segment.close()
