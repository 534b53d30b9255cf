"""The data-plane server: listening sockets, one thread per connection.

Threads, not asyncio, on purpose: each op's bulk bytes move with blocking recv_into/sendmsg
straight into or out of arena slots, which release the GIL and reach the raw loopback
figure (~3.8 GB/s here); an event loop would add a wake-up per partial read of every
megabyte. The store core is synchronous and thread-safe, so each connection calls it directly.

Two listeners: TCP (any host) and, for clients on this host, an abstract Unix-domain socket
with a random name (no file to guess; any uid may connect; the name reaches clients only in
HELLO's reply). Both speak the same protocol; only the Unix one can pass descriptors.

Limits before work: at most `max_connections` open, a quarter of them unauthenticated (past
that, a new connection takes the place of the oldest unauthenticated one: silent sockets
cannot lock clients out) and, where tenants share the daemon, three quarters per tenant
(`max_tenant_connections`); a new
connection must authenticate within `hello_timeout_s`, and an authenticated one is closed
after `idle_timeout_s` of silence (kernel socket timeouts, so blocking MSG_WAITALL reads keep
their speed: a few periods in a row of at most twice the reservation timeout, the one bound
each payload read and reply send has too, so no request sets a timeout of its own). Running
out of descriptors (EMFILE) pauses accepting, never stops it.

Shutdown: stop accepting, wake idle connections, let busy ones finish their op, then return.
"""
from __future__ import annotations

import collections
import errno
import logging
import secrets
import socket
import threading
import time

from kvstore import wire as w
from kvstore.daemon.config import ADMIN, DaemonConfig
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.namespaces import Registry
from kvstore.daemon.putchannel import Drainer
from kvstore.daemon.session import HANDLERS, Session
from kvstore.errors import KVStoreError, StoreClosedError
from transfer.errors import OUT_OF_RESOURCES
from transfer.sockio import Spin

log = logging.getLogger("kvtier.dataplane")
ACCEPT_BACKOFF_S = (0.01, 1.0)  # first and longest pause when the process is out of fds
PAYLOAD_OPS = frozenset((w.Op.PUT, w.Op.COMMIT))  # the only requests that carry block bytes
OP_LABELS = {op: op.name.lower() for op in w.Op}  # the `op` label of each op's figures


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # (--host ::1 too)
    sock = socket.create_server((host, port), family=family, backlog=128, reuse_port=False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def listen_local() -> tuple[socket.socket, str]:
    """An abstract Unix socket with an unguessable name; (socket, name without the NUL)."""
    name = f"kvtier-{secrets.token_hex(16)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    sock.listen(128)
    return sock, name


class ServedConnection:
    def __init__(self, sock: socket.socket, server: "DataPlane", local: bool) -> None:
        self.sock, self.server = sock, server
        self.busy = False
        self.pushed_out: str | None = None  # why another connection took its place
        self.tenant: str | None = None  # whose token this connection holds (counted per tenant)
        self.reader = w.FrameReader(sock, w.MAX_HELLO_HEADER_BYTES,
                                    time.monotonic() + server.cfg.hello_timeout_s)
        self.reader.spin = Spin(server.cfg.spin_us * 1e-6)  # (polls once authenticated)
        self.tally = server.metrics.tally()  # this connection's requests (given back in _close)
        self.session = Session(sock, self.reader, server.registry, server.cfg,
                               server.instance, server.local_name, local, self.tally,
                               server.drainer)

    @property
    def authenticated(self) -> bool:
        return self.session.hosted is not None

    def run(self) -> None:
        m = self.server.metrics
        try:
            while not self.server.stopping.is_set():
                frame = self.reader.frame(self.server.cfg.max_payload_bytes)
                # (a plain flag: shutdown reads it under its lock, but a frame read just
                # before it is set can be woken either way; taking the lock here too
                # closed no such window, and cost two lock visits per request)
                self.busy = True
                try:
                    self._serve(frame)
                finally:
                    self.busy = False
        except w.ProtocolError as e:
            m.protocol_errors.inc()
            self._send_error(e.code, str(e))
        except (ConnectionError, OSError, TimeoutError):
            if self.pushed_out:  # (else the client went away, timed out, or shutdown woke
                self._send_error(w.ErrorCode.UNAVAILABLE, self.pushed_out)  # us: no answer)
        finally:
            self._close()

    def _serve(self, frame: w.Frame) -> None:
        m, t0 = self.server.metrics, time.perf_counter()
        if frame.reply:
            raise w.ProtocolError(f"a client sent a reply frame ({frame.op.name})")
        was_authenticated = self.authenticated
        if frame.op is not w.Op.HELLO and not was_authenticated:
            raise w.ProtocolError(f"{frame.op.name} before HELLO: send HELLO (token and "
                                  "namespace) first")
        if frame.payload_bytes and frame.op not in PAYLOAD_OPS:
            # its bytes would be read as the next frame: the stream is out of step
            raise w.ProtocolError(f"{frame.op.name} takes no payload, but the frame "
                                  f"announces {frame.payload_bytes} bytes")
        outcome = "ok"
        hosted = None
        try:
            if frame.op is w.Op.HELLO:
                self._claim_tenant(frame.msg)
            if self.session.hosted is not None:  # (a clear waits for this request to end)
                if not self.session.hosted.enter():
                    raise StoreClosedError("its namespace is being cleared")
                hosted = self.session.hosted
            HANDLERS[frame.op](self.session, frame.msg, frame.payload_bytes)
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
            self._send_error(w.ErrorCode.UNAVAILABLE, f"the namespace's store is closed ({e}): "
                             "the daemon is stopping, or the namespace was cleared; connect "
                             "again")
            raise ConnectionError("store closed") from e
        except (KVStoreError, ValueError) as e:  # bad input the store refused
            outcome = "refused"
            self._send_error(w.ErrorCode.PROTOCOL, str(e))
        except (ConnectionError, *w.TIMED_OUT):  # a peer gone, or too slow to send to or
            outcome = "disconnected"  # hear from (a socket timeout: BlockingIOError): the
            raise  # connection ends, and the daemon had no fault in it
        except Exception as e:  # a bug or an I/O failure: say so, log it, end this connection
            outcome = "internal"
            m.internal_errors.inc()
            log.exception("%s failed", frame.op.name)
            self._send_error(w.ErrorCode.INTERNAL, f"{frame.op.name} failed inside the "
                             f"daemon ({type(e).__name__}); see its log")
            raise ConnectionError("internal error") from e
        finally:
            if hosted is not None:
                hosted.leave()
            n = len(getattr(frame.msg, "hashes", b"")) // 16
            self.tally.observe(OP_LABELS[frame.op], outcome, time.perf_counter() - t0, n)
            self.session.trim_scratch()
        if not was_authenticated and self.authenticated:
            period, periods = self.server.cfg.timeout_periods
            self.reader.authenticated(periods)
            w.kernel_timeouts(self.sock, period)
            self.server.authenticated(self)

    def _claim_tenant(self, hello: w.Hello) -> None:
        """Count this connection against the tenant its token grants, before the HELLO is
        served: past the tenant's cap it is refused (UNAVAILABLE), so one tenant cannot
        take every connection from the others. A bad token is the handler's to refuse."""
        tenant = self.server.cfg.tenant_of(hello.token)
        if tenant is not None and tenant != self.tenant:
            refused = self.server.move_tenant(self, tenant)
            if refused is not None:
                self.server.metrics.connections_refused.inc()
                raise w.RemoteError(w.ErrorCode.UNAVAILABLE, refused)

    def _send_error(self, code: w.ErrorCode, message: str) -> None:
        try:
            w.send_frame(self.sock, w.Error(code=int(code), message=message), w.Op.ERROR, True)
        except OSError:
            pass  # the client is gone; the error has nowhere to go

    def _close(self) -> None:
        hosted = self.session.hosted
        entered = hosted is not None and hosted.enter()  # (a clear waits for this too)
        try:  # (not entered: a clear is closing the store meanwhile; it is left alone)
            self.session.end(store=entered or hosted is None)
        except StoreClosedError:
            pass  # stores closed at shutdown: their reservations and leases went with them
        finally:
            if entered:
                hosted.leave()
            self.sock.close()
            self.server.metrics.retire(self.tally)
            self.server.forget(self)

    def push_out(self, message: str) -> None:
        """Closed from outside (it made room for another). Its own thread, the only writer
        of its socket, tells the client why: the read it waits in ends (shutdown of the
        reading side only) and it answers UNAVAILABLE before it closes."""
        self.pushed_out = message
        try:
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def wake_if_idle(self) -> None:
        if not self.busy:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class DataPlane:
    def __init__(self, cfg: DaemonConfig, registry: Registry, metrics: Metrics,
                 sock: socket.socket, local: tuple[socket.socket, str] | None = None) -> None:
        self.cfg, self.registry, self.metrics, self.sock = cfg, registry, metrics, sock
        self.local_sock, self.local_name = local if local else (None, "")
        self.instance = secrets.token_bytes(16)  # tells clients the local socket is ours
        self.drainer = Drainer() if self.local_sock is not None else None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.conns: dict[ServedConnection, threading.Thread] = {}
        # connections not yet authenticated, oldest first: when they fill their quota, a
        # new one takes the place of the oldest (refusing it instead let anyone holding
        # silent sockets lock every client out, token or not)
        self.pending: collections.OrderedDict[ServedConnection, None] = collections.OrderedDict()
        self.tenant_conns: collections.Counter[str] = collections.Counter()
        self._acceptors = [threading.Thread(target=self._accept, args=(s, s is self.local_sock),
                                            name="kvtier-accept", daemon=True)
                           for s in (sock, self.local_sock) if s is not None]

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def accepting(self) -> bool:
        """Every acceptor thread still runs (the control plane's health check)."""
        return not self.stopping.is_set() and all(t.is_alive() for t in self._acceptors)

    def start(self) -> None:
        for t in self._acceptors:
            t.start()

    def _accept(self, listener: socket.socket, local: bool) -> None:
        pause = ACCEPT_BACKOFF_S[0]
        while not self.stopping.is_set():
            try:
                sock, _ = listener.accept()
            except OSError as e:
                if self.stopping.is_set() or e.errno in (errno.EBADF, errno.EINVAL):
                    return  # listening socket closed: shutting down
                if e.errno not in OUT_OF_RESOURCES:
                    continue  # one connection that died before we took it
                self.metrics.accept_errors.inc()
                log.warning("cannot accept a connection (%s): pausing %.2fs; raise the open "
                            "file limit (ulimit -n) or lower --max-connections", e, pause)
                time.sleep(pause)
                pause = min(pause * 2, ACCEPT_BACKOFF_S[1])
                continue
            pause = ACCEPT_BACKOFF_S[0]
            self._admit(sock, local)

    def _admit(self, sock: socket.socket, local: bool) -> None:
        try:
            if not local:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            w.size_buffers(sock)
            w.kernel_timeouts(sock, self.cfg.hello_timeout_s)
            conn = ServedConnection(sock, self, local)
        except OSError:
            sock.close()
            return
        with self.lock:
            refused = self._over_limit()
            evicted = None
            if refused is None:
                if len(self.pending) >= self.pending_quota:
                    evicted, _ = self.pending.popitem(last=False)
                self.conns[conn] = threading.Thread(target=conn.run, name="kvtier-conn",
                                                    daemon=True)
                self.pending[conn] = None
        if evicted is not None:
            self.metrics.connections_refused.inc()
            evicted.push_out("too many connections waiting to authenticate: this one, the "
                             "oldest, made room; retry")
        if refused is not None:
            self.metrics.connections_refused.inc()
            self.metrics.retire(conn.tally)  # (it never runs: run's _close would do it)
            conn._send_error(w.ErrorCode.UNAVAILABLE, refused)
            sock.close()
            return
        self.metrics.connections.inc()
        self.metrics.connections_total.inc()
        self.conns[conn].start()

    def _over_limit(self) -> str | None:
        if self.stopping.is_set():
            return "the daemon is shutting down"
        if len(self.conns) >= self.cfg.max_connections:
            return f"the daemon is at its connection limit ({self.cfg.max_connections}); retry"
        return None

    @property
    def pending_quota(self) -> int:
        return max(1, self.cfg.max_connections // 4)

    def move_tenant(self, conn: ServedConnection, tenant: str) -> str | None:
        """Count `conn` under `tenant` (and no longer under the one it held), or say why
        not: the tenant holds its cap of connections already (admin tokens are uncapped)."""
        cap = self.cfg.tenant_connection_cap
        with self.lock:
            held = self.tenant_conns[tenant]
            if cap and tenant != ADMIN and held >= cap:
                return (f"tenant {tenant!r} holds {held} connections, the most one tenant may "
                        "(--max-tenant-connections): close some, or share them (a Client "
                        "pools its connections)")
            self._uncount_tenant(conn)
            self.tenant_conns[tenant] += 1
            conn.tenant = tenant
        return None

    def _uncount_tenant(self, conn: ServedConnection) -> None:
        if conn.tenant is not None:
            self.tenant_conns[conn.tenant] -= 1
            if not self.tenant_conns[conn.tenant]:
                del self.tenant_conns[conn.tenant]
            conn.tenant = None

    def authenticated(self, conn: ServedConnection) -> None:
        with self.lock:
            self.pending.pop(conn, None)

    def forget(self, conn: ServedConnection) -> None:
        with self.lock:
            self._uncount_tenant(conn)
            if self.conns.pop(conn, None) is not None:
                self.metrics.connections.dec()
            self.pending.pop(conn, None)

    def shutdown(self, grace_s: float) -> None:
        """Stop accepting; idle connections close now, busy ones after their current op."""
        self.stopping.set()
        for listener in (self.sock, self.local_sock):
            if listener is None:
                continue
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
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
        if self.drainer is not None:
            self.drainer.close()
