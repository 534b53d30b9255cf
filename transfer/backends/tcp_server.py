"""The tcp backend's listening side: serves peers' READ/WRITE/NOTIFY on its agent's memory.

One thread per accepted connection, requests served in arrival order, so responses come back
in order. A request naming memory the agent did not export gets an ERROR reply (its payload
is drained, the connection lives on); a malformed frame gets an ERROR reply and the
connection is closed. Data is acknowledged only after all of it has landed.

A peer must complete HELLO within `io_timeout_s` of connecting (a deadline, not a per-read
timeout: a byte every few seconds does not keep it open), and at most MAX_PENDING peers
wait for theirs: one more pushes out the oldest, so a flood of silent connections, which
needs no key, costs bounded threads and descriptors and locks no peer out. Running out of
descriptors pauses accepting, never stops it.
"""
from __future__ import annotations

import collections
import errno
import hmac
import logging
import socket
import threading
import time

import numpy as np

from ..errors import OUT_OF_RESOURCES, Fault, TransferError
from ..memory import check_ranges, finish_staged, host_views
from ..sockio import Spin
from ..types import Notification
from .base import AgentContext
from .tcp_wire import (MAX_HELLO_BYTES, Kind, Progress, desc_arrays, drain, frame,
                       protocol_error, recv_frame, recv_views, send_views, tune)

log = logging.getLogger("kvtier.transfer")
MAX_PENDING = 64  # connections waiting to complete HELLO, per listener
ACCEPT_BACKOFF_S = (0.05, 1.0)


class Server:
    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self._stop = threading.Event()
        host = ctx.config.tcp_host
        self._sock = socket.create_server((host, ctx.config.tcp_port), backlog=128,
                                          family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.settimeout(0.2)
        self.addr = self._sock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        # not yet past HELLO, oldest first: socket -> the deadline of its HELLO
        self._pending: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvt-tcp-accept-{ctx.name}")
        self._thread.start()

    def _accept_loop(self) -> None:
        pause = ACCEPT_BACKOFF_S[0]
        while not self._stop.is_set():
            self._expire_pending(time.monotonic())
            try:
                sock, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self._stop.is_set() or e.errno in (errno.EBADF, errno.EINVAL):
                    return  # listener closed
                if e.errno in OUT_OF_RESOURCES:  # (exiting here left the agent deaf for good)
                    log.warning("transfer agent %s cannot accept a connection (%s): pausing "
                                "%.2fs", self.ctx.name, e, pause)
                    time.sleep(pause)
                    pause = min(2 * pause, ACCEPT_BACKOFF_S[1])
                continue  # else one connection that died before we took it
            pause = ACCEPT_BACKOFF_S[0]
            try:
                tune(sock, self.ctx.config.tcp_sock_buf_bytes)
            except OSError:
                sock.close()
                continue
            with self._lock:
                self._conns.add(sock)
                self._pending[sock] = time.monotonic() + self.ctx.config.io_timeout_s
                oldest = (self._pending.popitem(last=False)[0]
                          if len(self._pending) > MAX_PENDING else None)
            if oldest is not None:
                _shut(oldest)  # its thread ends it
            try:
                threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                 name=f"kvt-tcp-serve-{self.ctx.name}").start()
            except RuntimeError:  # no thread to be had: this one is refused
                with self._lock:
                    self._conns.discard(sock)
                    self._pending.pop(sock, None)
                sock.close()

    def _expire_pending(self, now: float) -> None:
        """Close the connections whose HELLO deadline passed (oldest first: the first one
        still within its deadline ends the sweep)."""
        late = []
        with self._lock:
            while self._pending:
                sock, deadline = next(iter(self._pending.items()))
                if deadline > now:
                    break
                del self._pending[sock]
                late.append(sock)
        for sock in late:
            _shut(sock)

    def _admitted(self, sock: socket.socket) -> None:
        with self._lock:
            self._pending.pop(sock, None)

    def _serve(self, sock: socket.socket) -> None:
        conn = _ServerConn(self.ctx, sock, self._stop.is_set, lambda: self._admitted(sock))
        try:
            conn.run()
        except TransferError as e:
            conn.try_send_error(0, e)  # the peer learns why before the close
        except Exception:  # a bug: this connection ends, logged; the agent serves on
            log.exception("transfer agent %s: serving peer %s failed", self.ctx.name,
                          conn.peer)
        finally:
            self.ctx.grants.forget(conn)
            with self._lock:
                self._conns.discard(sock)
                self._pending.pop(sock, None)
            sock.close()

    def forked(self) -> None:
        """(TcpBackend.forked) Closes this process's descriptors of the listening socket and
        the served connections: the parent's stay open, its server untouched. (No thread
        of its runs here; nothing that may wait on a lock a parent's thread held.)"""
        self._sock.close()
        for s in list(self._conns):
            s.close()

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop now, not at its poll
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _ServerConn:
    def __init__(self, ctx: AgentContext, sock: socket.socket, stopped, admitted=lambda: None):
        self.ctx = ctx
        self.sock = sock
        self.stopped = stopped
        self.admitted = admitted
        self.progress = Progress()
        self.peer = "?"
        self.spin = Spin(0.0)  # polls once the peer is admitted (AgentConfig.spin_us)
        cfg = ctx.config  # a request's header: its descriptors (8 bytes each of id, offset
        self.max_header = 24 * cfg.max_descs + cfg.max_note_bytes + 1024  # and length) + note

    def _recv(self, idle_ok: bool):
        return recv_frame(self.sock, self.progress, self.ctx.config.io_timeout_s,
                          self.stopped, self.ctx.config.max_frame_bytes, idle_ok,
                          self.max_header, spin=self.spin)

    def _send(self, views) -> None:
        send_views(self.sock, views, self.progress, self.ctx.config.io_timeout_s,
                   self.stopped)

    def close(self) -> None:
        """End this connection from another thread (its key was revoked)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def run(self) -> None:
        # a peer has io_timeout_s to say HELLO, in one small frame with no payload
        kind, header, plen = recv_frame(self.sock, self.progress, self.ctx.config.io_timeout_s,
                                        self.stopped, 0, False, MAX_HELLO_BYTES)
        if kind is not Kind.HELLO or len(header) != 3 or plen:
            raise protocol_error("expected HELLO first")
        target, peer, key = header
        # One refusal for a wrong agent id and a missing or wrong key, naming nothing: a
        # stranger learns neither which agent listens here nor what it holds.
        known = isinstance(target, str) and hmac.compare_digest(target.encode(),
                                                                self.ctx.agent_id.encode())
        if not (self.ctx.grants.admit(key, self) and known):
            raise TransferError(Fault.REFUSED, "refused")
        self.peer = str(peer)
        self.admitted()
        self.spin = Spin(self.ctx.config.spin_us * 1e-6)
        self._send([frame(Kind.ACK, [0])])
        while True:
            kind, header, plen = self._recv(idle_ok=True)
            if kind is Kind.WRITE:
                self._write(header, plen)
            elif kind is Kind.READ and not plen:
                self._read(header)
            elif kind is Kind.NOTIFY and len(header) == 2 and isinstance(header[1], bytes) \
                    and not plen:
                self._check_note(header[1])
                self.ctx.deliver(Notification(self.peer, header[1]))
                self._send([frame(Kind.ACK, [header[0]])])
            else:
                raise protocol_error(f"unexpected {kind.name} frame")

    def _check_note(self, note: bytes) -> None:
        limit = self.ctx.config.max_note_bytes
        if len(note) > limit:
            raise protocol_error(f"a notification of {len(note)} bytes (at most {limit})")

    def _validate(self, ids, offs, lens):
        """The request's regions, in use by this connection (`done` them after)."""
        if ids.size > self.ctx.config.max_descs:  # (the header's bound keeps it so anyway)
            raise protocol_error(f"a request of {ids.size} descriptors (at most "
                                 f"{self.ctx.config.max_descs})")
        check_ranges(self.ctx.regions.exported_sizes, ids, offs, lens)
        unique = ids.tolist() if ids.size == 1 else np.unique(ids).tolist()
        return self.ctx.regions.use(unique, self)

    def _write(self, header: list, plen: int) -> None:
        seq, ids, offs, lens, note = desc_arrays(header)
        if int(lens.sum()) != plen:
            raise protocol_error(f"WRITE payload {plen} bytes != descriptors {lens.sum()}")
        if note is not None:
            self._check_note(note)
        try:
            regions = self._validate(ids, offs, lens)
        except TransferError as e:
            if e.fault is Fault.PROTOCOL:
                raise
            drain(self.sock, plen, self.progress, self.ctx.config.io_timeout_s, self.stopped)
            self._send([frame(Kind.ERROR, [seq, e.fault.name, e.cause])])
            return
        try:
            views, finish = host_views(regions, ids, offs, lens, incoming=True)
            recv_views(self.sock, views, self.progress, self.ctx.config.io_timeout_s,
                       self.stopped)
            finish_staged(finish)
        finally:
            self.ctx.regions.done(list(regions), self)
        if note is not None:
            self.ctx.deliver(Notification(self.peer, note))
        self._send([frame(Kind.ACK, [seq])])

    def _read(self, header: list) -> None:
        seq, ids, offs, lens, note = desc_arrays(header)
        try:
            nbytes = int(lens.sum())  # (each length within a region, once checked: no
            regions = self._validate(ids, offs, lens)  # overflow)
        except TransferError as e:
            if e.fault is Fault.PROTOCOL:
                raise
            self._send([frame(Kind.ERROR, [seq, e.fault.name, e.cause])])
            return
        try:
            if nbytes > self.ctx.config.max_frame_bytes:
                self._send([frame(Kind.ERROR, [seq, Fault.OUT_OF_RANGE.name,
                                              f"a READ of {nbytes} bytes (at most "
                                              f"{self.ctx.config.max_frame_bytes} a request)"])])
                return
            views, _ = host_views(regions, ids, offs, lens, incoming=False)
            self._send([frame(Kind.DATA, [seq], nbytes), *views])
        finally:
            self.ctx.regions.done(list(regions), self)

    def try_send_error(self, seq: int, err: TransferError) -> None:
        if err.fault in (Fault.CONNECTION_LOST, Fault.CLOSED):
            return
        try:
            self.sock.settimeout(0.5)
            self.sock.sendall(frame(Kind.ERROR, [seq, err.fault.name, err.cause]))
        except OSError:
            pass  # the close that follows tells the peer anyway
