"""The data-plane server: a listening socket, one thread per connection.

Threads, not asyncio, on purpose: each op's bulk bytes move with blocking recv_into/sendmsg
straight into or out of arena slots, which release the GIL and reach the raw loopback
figure (~3.8 GB/s here); an event loop would add a wake-up per partial read of every
megabyte. The store core is synchronous and thread-safe, so each connection calls it directly.

Shutdown: stop accepting, wake idle connections, let busy ones finish their op, then return.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from kvstore import wire as w
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.namespaces import Registry
from kvstore.daemon.session import HANDLERS, Session
from kvstore.errors import KVStoreError, StoreClosedError

log = logging.getLogger("kvtier.dataplane")


def listen(host: str, port: int) -> socket.socket:
    sock = socket.create_server((host, port), backlog=128, reuse_port=False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


class Connection:
    def __init__(self, sock: socket.socket, server: "DataPlane") -> None:
        self.sock, self.server = sock, server
        self.busy = False
        self.reader = w.FrameReader(sock)
        self.session = Session(sock, self.reader, server.registry, server.cfg)

    def run(self) -> None:
        m = self.server.metrics
        try:
            while not self.server.stopping.is_set():
                frame = self.reader.frame(self.server.cfg.max_payload_bytes)
                with self.server.lock:
                    self.busy = True
                try:
                    self._serve(frame)
                finally:
                    with self.server.lock:
                        self.busy = False
        except w.ProtocolError as e:
            m.protocol_errors.inc()
            self._send_error(e.code, str(e))
        except (ConnectionError, OSError, TimeoutError):
            pass  # the client went away (or shutdown woke us): nothing to answer
        finally:
            self._close()

    def _serve(self, frame: w.Frame) -> None:
        m, t0 = self.server.metrics, time.perf_counter()
        if frame.reply:
            raise w.ProtocolError(f"a client sent a reply frame ({frame.op.name})")
        handler = HANDLERS[frame.op]
        outcome = "ok"
        try:
            handler(self.session, frame.msg, frame.payload_bytes)
        except w.ProtocolError:
            outcome = "protocol"
            raise  # answered and closed by run()
        except w.RemoteError as e:
            outcome = e.code.name.lower()
            self._send_error(e.code, str(e).split(": ", 1)[-1])
            if e.code is w.ErrorCode.AUTH:
                raise ConnectionError("authentication failed") from e
        except StoreClosedError as e:
            outcome = "unavailable"
            self._send_error(w.ErrorCode.UNAVAILABLE, f"the daemon is shutting down ({e})")
            raise ConnectionError("store closed") from e
        except (KVStoreError, ValueError) as e:  # bad input the store refused
            outcome = "refused"
            self._send_error(w.ErrorCode.PROTOCOL, str(e))
        finally:
            n = len(getattr(frame.msg, "hashes", b"")) // 16
            m.observe(frame.op.name.lower(), outcome, time.perf_counter() - t0, n)
            s = self.session
            if s.bytes_in:
                m.bytes_in.inc(s.bytes_in)
            if s.bytes_out:
                m.bytes_out.inc(s.bytes_out)
            s.bytes_in = s.bytes_out = 0

    def _send_error(self, code: w.ErrorCode, message: str) -> None:
        try:
            w.send_frame(self.sock, w.Error(code=int(code), message=message), w.Op.ERROR, True)
        except OSError:
            pass  # the client is gone; the error has nowhere to go

    def _close(self) -> None:
        try:
            self.session.close_ops()
        except StoreClosedError:
            pass  # stores closed at shutdown: their reservations and leases went with them
        finally:
            self.session.close()
        self.sock.close()
        self.server.forget(self)

    def wake_if_idle(self) -> None:
        if not self.busy:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class DataPlane:
    def __init__(self, cfg: DaemonConfig, registry: Registry, metrics: Metrics,
                 sock: socket.socket) -> None:
        self.cfg, self.registry, self.metrics, self.sock = cfg, registry, metrics, sock
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.conns: dict[Connection, threading.Thread] = {}
        self._acceptor = threading.Thread(target=self._accept, name="kvtier-accept", daemon=True)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self) -> None:
        self._acceptor.start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return  # listening socket closed: shutting down
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            conn = Connection(sock, self)
            thread = threading.Thread(target=conn.run, name="kvtier-conn", daemon=True)
            with self.lock:
                if self.stopping.is_set():
                    sock.close()
                    return
                self.conns[conn] = thread
            self.metrics.connections.inc()
            self.metrics.connections_total.inc()
            thread.start()

    def forget(self, conn: Connection) -> None:
        with self.lock:
            if self.conns.pop(conn, None) is not None:
                self.metrics.connections.dec()

    def shutdown(self, grace_s: float) -> None:
        """Stop accepting; idle connections close now, busy ones after their current op."""
        self.stopping.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self.lock:
                conns = list(self.conns.items())
                for conn, _ in conns:
                    conn.wake_if_idle()
            if not conns:
                break
            conns[0][1].join(timeout=0.05)
        with self.lock:
            left = len(self.conns)
        if left:
            log.warning("%d connections still busy after %.1fs; closing the stores anyway",
                        left, grace_s)
