"""One client connection of the tcp backend: a sender thread and a receiver thread.

Requests are queued by `submit` (never blocking the caller on the network), sent in order by
the sender, and matched in the same order by the receiver against the server's replies, so
many transfers are in flight on one connection. A caller that waits for its transfer anyway
(`Agent.transfer`) may instead run it on its own thread when the connection is idle
(`run_inline`): no hand-off to the sender, to the receiver and back. Any I/O or protocol
failure kills the connection and fails every transfer still on it — none of them is ever
reported DONE.
"""
from __future__ import annotations

import queue
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import Fault, TransferError
from ..handle import Transfer
from ..memory import finish_staged
from ..sockio import Spin
from ..types import AgentConfig
from .tcp_wire import Kind, Progress, frame, recv_frame, recv_views, send_views, tune


@dataclass(eq=False)
class PendingOp:
    """One frame to send and what to do with its reply."""

    seq: int
    kind: Kind
    head: bytes  # frame head + msgpack header
    xfer: Transfer
    send: list = field(default_factory=list)  # payload views (WRITE)
    recv: list = field(default_factory=list)  # where DATA lands (READ)
    recv_bytes: int = 0
    finish: list = field(default_factory=list)  # device copies after DATA landed
    then_notify: bytes | None = None  # READ with a notification: NOTIFY after the data
    refused: TransferError | None = None  # the peer's ERROR reply (`_complete` fails it)


class PeerConnection:
    def __init__(self, config: AgentConfig, addr: tuple[str, int], peer_agent_id: str,
                 my_name: str, key: bytes = b""):
        self.config = config
        self.progress = Progress()
        self._dead: TransferError | None = None
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[PendingOp | None] = queue.SimpleQueue()
        self._inflight: deque[PendingOp] = deque()
        self._has_inflight = threading.Condition(self._lock)
        self._receiving: PendingOp | None = None  # the request the receive thread lands
        # held while a request is being sent, and by an inline request until its reply is in
        self._io = threading.Lock()
        self._seq = 0
        # polls for a reply before sleeping (whichever thread takes it: one at a time)
        self.spin = Spin(config.spin_us * 1e-6)
        self.sock = self._connect(addr, peer_agent_id, my_name, key)
        for target, role in ((self._send_loop, "send"), (self._recv_loop, "recv")):
            threading.Thread(target=target, daemon=True, name=f"kvt-tcp-{role}").start()

    def _connect(self, addr, peer_agent_id: str, my_name: str, key: bytes) -> socket.socket:
        try:
            sock = socket.create_connection(addr, timeout=self.config.connect_timeout_s)
        except socket.timeout as e:
            raise TransferError(Fault.TIMEOUT, f"connect to {addr} timed out") from e
        except OSError as e:
            raise TransferError(Fault.PEER_GONE, f"cannot connect to {addr}: {e}") from e
        try:
            tune(sock, self.config.tcp_sock_buf_bytes)
            send_views(sock, [frame(Kind.HELLO, [peer_agent_id, my_name, key])], self.progress,
                       self.config.connect_timeout_s, lambda: False)
            kind, header, _ = recv_frame(sock, self.progress, self.config.connect_timeout_s,
                                         lambda: False, 0, idle_ok=False)
        except TransferError:
            sock.close()
            raise
        if kind is not Kind.ACK:
            sock.close()
            raise _reply_error(header, f"peer at {addr} refused the connection")
        return sock

    @property
    def dead(self) -> bool:
        return self._dead is not None

    def next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def submit(self, req: PendingOp) -> None:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._queue.put(req)

    def run_inline(self, req: PendingOp) -> bool:
        """Send `req` and take its reply on the calling thread, if nothing is queued or in
        flight on this connection (False, nothing done: `submit` it instead). The sender
        waits for it (`_io`), and the receiver only takes replies to what the sender put
        in flight, so neither touches the socket meanwhile. A 256 KiB READ on loopback:
        the three thread hand-offs it saves were most of its time."""
        if not self._io.acquire(blocking=False):
            return False
        try:
            with self._lock:
                if self._dead is not None:
                    raise self._dead
                if self._inflight or not self._queue.empty():
                    return False
                self.progress.t = time.monotonic()
            try:
                send_views(self.sock, [req.head, *req.send], self.progress,
                           self.config.io_timeout_s, self._is_dead)
                self._recv_reply(req)
            except Exception as e:  # (any: see _broken)
                self._die(_broken(e))
                req.xfer._fail(self._dead)
                return True
        finally:
            self._io.release()
        self._complete(req)
        return True

    def _send_loop(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
            with self._io:
                with self._lock:
                    if self._dead is not None:
                        req.xfer._fail(self._dead)
                        continue
                    self._inflight.append(req)
                    self.progress.t = time.monotonic()  # a new request starts a fresh clock
                    self._has_inflight.notify()
                try:
                    send_views(self.sock, [req.head, *req.send], self.progress,
                               self.config.io_timeout_s, self._is_dead)
                except Exception as e:  # (any: see _broken)
                    self._die(_broken(e))

    def _recv_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._inflight and self._dead is None:
                        self._has_inflight.wait(0.5)
                    if self._dead is not None:
                        return
                    req = self._receiving = self._inflight[0]
                try:
                    self._recv_reply(req)
                except Exception:
                    with self._lock:
                        self._receiving = None  # (failed by the _die below)
                    raise
                with self._lock:
                    self._receiving = None
                    self._inflight.popleft()
                self._complete(req)  # (whole: done, even if the connection died meanwhile)
        except Exception as e:  # (any: see _broken)
            self._die(_broken(e))

    def _recv_reply(self, req: PendingOp) -> None:
        kind, header, plen = recv_frame(self.sock, self.progress, self.config.io_timeout_s,
                                        self._is_dead, req.recv_bytes, idle_ok=False,
                                        spin=self.spin)
        if not header or header[0] != req.seq:
            if kind is Kind.ERROR:  # connection-level refusal (seq 0)
                raise _reply_error(header, "peer closed the connection")
            raise TransferError(Fault.PROTOCOL, f"reply for seq {header[:1]}, expected "
                                f"{req.seq}")
        if kind is Kind.ERROR:
            req.recv = []
            req.refused = _reply_error(header, "peer refused the request")
        elif kind is Kind.DATA and req.kind is Kind.READ and plen == req.recv_bytes:
            recv_views(self.sock, req.recv, self.progress, self.config.io_timeout_s,
                       self._is_dead)
            finish_staged(req.finish)
        elif not (kind is Kind.ACK and req.kind is not Kind.READ and plen == 0):
            raise TransferError(Fault.PROTOCOL, f"unexpected {kind.name} reply to "
                                f"{req.kind.name} (payload {plen})")

    def _complete(self, req: PendingOp) -> None:
        """Finish `req`'s part of its transfer: refused, done, or done once its notification
        is acknowledged."""
        if req.refused is not None:
            req.xfer._fail(req.refused)
            return
        if req.then_notify is None:
            req.xfer._done_part()
            return
        seq = self.next_seq()
        try:
            self.submit(PendingOp(seq, Kind.NOTIFY, frame(Kind.NOTIFY, [seq, req.then_notify]),
                                req.xfer))
        except TransferError as e:
            req.xfer._fail(e)

    def _is_dead(self) -> bool:
        return self._dead is not None

    def _die(self, err: TransferError) -> None:
        """End the connection: every request on it fails, but the one the receiving thread
        is landing, which that thread finishes once its receive returns (whole, or cut by
        the shutdown here). Failed from here, a READ's bytes still buffered went on landing
        in its caller's memory after the handle said FAILED."""
        with self._lock:
            if self._dead is None:
                fault = Fault.CONNECTION_LOST if err.fault is Fault.CLOSED else err.fault
                self._dead = TransferError(fault, err.cause)
            failed = [r for r in self._inflight if r is not self._receiving]
            self._inflight = deque(r for r in self._inflight if r is self._receiving)
            while True:
                try:
                    req = self._queue.get_nowait()
                except queue.Empty:
                    break
                if req is not None:
                    failed.append(req)
            self._queue.put(None)  # stop the sender
            self._has_inflight.notify_all()
        for req in failed:
            req.xfer._fail(self._dead)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._die(TransferError(Fault.CLOSED, "connection closed by this agent"))
        self.sock.close()


def _broken(e: Exception) -> TransferError:
    """What ends a connection, as a TransferError: a socket call that raised anything else
    (a destination the socket cannot write into, say) had killed the thread, and its
    transfer and every later one on the connection stayed pending for good."""
    if isinstance(e, TransferError):
        return e
    return TransferError(Fault.INVALID, f"the connection failed: {type(e).__name__}: {e}")


def _reply_error(header: list, default: str) -> TransferError:
    """The peer's ERROR reply, keeping its fault (e.g., OUT_OF_RANGE) when it names one."""
    try:
        _, fault, message = header
        return TransferError(Fault[fault], f"peer says: {message}")
    except (ValueError, TypeError, KeyError):
        return TransferError(Fault.REMOTE, default)
