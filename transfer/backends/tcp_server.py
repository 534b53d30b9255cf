"""The tcp backend's listening side: serves peers' READ/WRITE/NOTIFY on its agent's memory.

One thread per accepted connection, requests served in arrival order, so responses come back
in order. A request naming memory the agent did not export gets an ERROR reply (its payload
is drained, the connection lives on); a malformed frame gets an ERROR reply and the
connection is closed. Data is acknowledged only after all of it has landed.
"""
from __future__ import annotations

import hmac
import socket
import threading

import numpy as np

from ..errors import Fault, TransferError
from ..memory import check_ranges, finish_staged, host_views
from ..types import Notification
from .base import AgentContext
from .tcp_wire import (MAX_HELLO_BYTES, Kind, Progress, desc_arrays, drain, frame,
                       protocol_error, recv_frame, recv_views, send_views, tune)


class Server:
    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self._stop = threading.Event()
        self._sock = socket.create_server((ctx.config.tcp_host, ctx.config.tcp_port),
                                          backlog=128)
        self._sock.settimeout(0.2)
        self.addr = self._sock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvt-tcp-accept-{ctx.name}")
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # listener closed
            tune(sock, self.ctx.config.tcp_sock_buf_bytes)
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name=f"kvt-tcp-serve-{self.ctx.name}").start()

    def _serve(self, sock: socket.socket) -> None:
        conn = _ServerConn(self.ctx, sock, self._stop.is_set)
        try:
            conn.run()
        except TransferError as e:
            conn.try_send_error(0, e)  # the peer learns why before the close
        finally:
            self.ctx.grants.forget(conn)
            with self._lock:
                self._conns.discard(sock)
            sock.close()

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


class _ServerConn:
    def __init__(self, ctx: AgentContext, sock: socket.socket, stopped):
        self.ctx = ctx
        self.sock = sock
        self.stopped = stopped
        self.progress = Progress()
        self.peer = "?"

    def _recv(self, idle_ok: bool):
        return recv_frame(self.sock, self.progress, self.ctx.config.io_timeout_s,
                          self.stopped, self.ctx.config.max_frame_bytes, idle_ok)

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
        self._send([frame(Kind.ACK, [0])])
        while True:
            kind, header, plen = self._recv(idle_ok=True)
            if kind is Kind.WRITE:
                self._write(header, plen)
            elif kind is Kind.READ and not plen:
                self._read(header)
            elif kind is Kind.NOTIFY and len(header) == 2 and isinstance(header[1], bytes) \
                    and not plen:
                self.ctx.deliver(Notification(self.peer, header[1]))
                self._send([frame(Kind.ACK, [header[0]])])
            else:
                raise protocol_error(f"unexpected {kind.name} frame")

    def _validate(self, ids, offs, lens):
        check_ranges(self.ctx.regions.exported_sizes, ids, offs, lens)
        regions = {i: self.ctx.regions.get(i) for i in np.unique(ids).tolist()}
        return regions

    def _write(self, header: list, plen: int) -> None:
        seq, ids, offs, lens, note = desc_arrays(header)
        if int(lens.sum()) != plen:
            raise protocol_error(f"WRITE payload {plen} bytes != descriptors {lens.sum()}")
        try:
            regions = self._validate(ids, offs, lens)
        except TransferError as e:
            drain(self.sock, plen, self.progress, self.ctx.config.io_timeout_s, self.stopped)
            self._send([frame(Kind.ERROR, [seq, e.fault.name, e.cause])])
            return
        views, finish = host_views(regions, ids, offs, lens, incoming=True)
        recv_views(self.sock, views, self.progress, self.ctx.config.io_timeout_s, self.stopped)
        finish_staged(finish)
        if note is not None:
            self.ctx.deliver(Notification(self.peer, note))
        self._send([frame(Kind.ACK, [seq])])

    def _read(self, header: list) -> None:
        seq, ids, offs, lens, note = desc_arrays(header)
        try:
            regions = self._validate(ids, offs, lens)
        except TransferError as e:
            self._send([frame(Kind.ERROR, [seq, e.fault.name, e.cause])])
            return
        views, _ = host_views(regions, ids, offs, lens, incoming=False)
        self._send([frame(Kind.DATA, [seq], int(lens.sum())), *views])

    def try_send_error(self, seq: int, err: TransferError) -> None:
        if err.fault in (Fault.CONNECTION_LOST, Fault.CLOSED):
            return
        try:
            self.sock.settimeout(0.5)
            self.sock.sendall(frame(Kind.ERROR, [seq, err.fault.name, err.cause]))
        except OSError:
            pass  # the close that follows tells the peer anyway
