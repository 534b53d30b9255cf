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
import selectors
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
    sock = socket.create_server((host, port), family=family, backlog=4096, reuse_port=False)
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
    def __init__(self, sock: socket.socket, server: "DataPlane", local: bool,
                 first: bytes = b"", deadline: float | None = None) -> None:
        """`first`: the connection's first frame, read by the lobby (see DataPlane), due
        whole by `deadline` (hello_timeout_s from now if None)."""
        self.sock, self.server = sock, server
        self.busy = False
        self.tenant: str | None = None  # whose token this connection holds (counted per tenant)
        self.reader = w.FrameReader(sock, w.MAX_HELLO_HEADER_BYTES, deadline if deadline
                                    is not None else time.monotonic() + server.cfg.hello_timeout_s)
        if first:
            self.reader.buffered.load(first)
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
            pass  # the client went away, timed out, or shutdown woke us: no answer
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
            if e.code is w.ErrorCode.AUTH or not was_authenticated:
                # (a refused first HELLO ends its connection: kept open, it held a place
                # outside the lobby, beyond eviction, until its hello deadline)
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
            self.session.end(store=entered or hosted is None,
                             stopping=self.server.stopping.is_set())
        except StoreClosedError:
            pass  # stores closed at shutdown: their reservations and leases went with them
        finally:
            if entered:
                hosted.leave()
            self.sock.close()
            self.server.metrics.retire(self.tally)
            self.server.forget(self)

    def wake_if_idle(self) -> None:
        if not self.busy:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _say(sock: socket.socket, code: w.ErrorCode, message: str) -> None:
    """An ERROR frame to a connection about to be closed, best effort: never blocks (it
    fits the empty send buffer of a connection that has sent one frame at most)."""
    try:
        sock.send(w.encode(w.Error(code=int(code), message=message), w.Op.ERROR, True),
                  socket.MSG_DONTWAIT)
    except OSError:
        pass


class _Waiting:
    """A connection the lobby holds until its first frame is whole."""
    __slots__ = ("sock", "local", "deadline", "buf", "got", "need")

    def __init__(self, sock: socket.socket, local: bool, deadline: float) -> None:
        self.sock, self.local, self.deadline = sock, local, deadline
        self.buf = bytearray(w.PREFIX.size)  # the frame so far: its prefix, then its header
        self.got, self.need = 0, w.PREFIX.size


class DataPlane:
    """The listeners and their connections. New connections wait in the lobby, one thread
    with every listener and every connection that has not sent its first frame whole on one
    epoll: it accepts them, reads their first frames with non-blocking calls, and starts a
    connection's thread once its first frame (a HELLO, or the error it gets) is in. A
    thread started per connection at accept let a flood of connections from one process
    outrun accept (threads started, then pushed out, all contending for the GIL): the
    listen queue stayed full, the kernel dropped new SYNs, and clients with a token failed
    to connect for seconds at a time."""

    LOBBY_BATCH = 64  # connections accepted per wake-up, at most, before reading first frames

    def __init__(self, cfg: DaemonConfig, registry: Registry, metrics: Metrics,
                 sock: socket.socket, local: tuple[socket.socket, str] | None = None) -> None:
        self.cfg, self.registry, self.metrics, self.sock = cfg, registry, metrics, sock
        self.local_sock, self.local_name = local if local else (None, "")
        self.instance = secrets.token_bytes(16)  # tells clients the local socket is ours
        self.drainer = Drainer() if self.local_sock is not None else None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.conns: dict[ServedConnection, threading.Thread] = {}
        # connections in the lobby (no first frame yet), oldest first: when they fill their
        # quota, a new one takes the place of the oldest (refusing it instead let anyone
        # holding silent sockets lock every client out, token or not)
        self.pending: collections.OrderedDict[_Waiting, None] = collections.OrderedDict()
        self.tenant_conns: collections.Counter[str] = collections.Counter()
        self._wake_r, self._wake_w = socket.socketpair()  # shutdown wakes the lobby
        self._lobby = threading.Thread(target=self._run_lobby, name="kvtier-accept",
                                       daemon=True)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def accepting(self) -> bool:
        """The lobby still runs (the control plane's health check)."""
        return not self.stopping.is_set() and self._lobby.is_alive()

    def start(self) -> None:
        self._lobby.start()

    # ------------------------------------------------------------ the lobby

    def _run_lobby(self) -> None:
        sel = selectors.DefaultSelector()
        listeners = {s: s is self.local_sock for s in (self.sock, self.local_sock)
                     if s is not None}
        paused: dict[socket.socket, float] = {}  # listener -> when to accept again (EMFILE)
        pause = ACCEPT_BACKOFF_S[0]
        try:
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            for listener in listeners:
                listener.setblocking(False)
                sel.register(listener, selectors.EVENT_READ, listener)
            while not self.stopping.is_set():
                now = time.monotonic()
                for listener, at in list(paused.items()):
                    if at <= now:
                        del paused[listener]
                        sel.register(listener, selectors.EVENT_READ, listener)
                wake = [1.0] + [at - now for at in paused.values()]
                with self.lock:
                    oldest = next(iter(self.pending), None)
                if oldest is not None:
                    wake.append(oldest.deadline - now)
                for key, _ in sel.select(max(0.0, min(wake))):
                    if key.data is None or self.stopping.is_set():
                        continue  # (woken to stop)
                    try:
                        if isinstance(key.data, _Waiting):
                            self._read_first(key.data, sel)
                        elif self._accept_some(key.data, listeners[key.data], sel):
                            pause = ACCEPT_BACKOFF_S[0]
                        else:  # out of descriptors: this listener rests a while
                            sel.unregister(key.data)
                            paused[key.data] = time.monotonic() + pause
                            pause = min(pause * 2, ACCEPT_BACKOFF_S[1])
                    except Exception:  # noqa: BLE001 - one connection's trouble (memory, a
                        # limit) never ends the lobby: it alone accepts for the daemon
                        log.exception("the data plane's lobby failed on one event; going on")
                        if isinstance(key.data, _Waiting) and self._leave_lobby(key.data):
                            self._drop(key.data, None, sel)
                self._expire(sel)
        finally:
            with self.lock:
                left, self.pending = list(self.pending), collections.OrderedDict()
            for waiting in left:
                self._drop(waiting, None)
            sel.close()

    def _accept_some(self, listener: socket.socket, local: bool,
                     sel: selectors.BaseSelector) -> bool:
        """Accept what the listener holds, LOBBY_BATCH at most; False once out of
        descriptors (accepting pauses, then resumes: never stops)."""
        for _ in range(self.LOBBY_BATCH):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                if self.stopping.is_set() or e.errno in (errno.EBADF, errno.EINVAL):
                    return True  # listening socket closed: shutting down
                if e.errno not in OUT_OF_RESOURCES:
                    continue  # one connection that died before we took it
                self.metrics.accept_errors.inc()
                log.warning("cannot accept a connection (%s): pausing; raise the open file "
                            "limit (ulimit -n) or lower --max-connections", e)
                return False
            self._admit(sock, local, sel)
        return True

    def _admit(self, sock: socket.socket, local: bool, sel: selectors.BaseSelector) -> None:
        """Into the lobby, room made if need be: past the lobby's quota, or at the limit,
        the oldest waiting connection is pushed out (at the limit too: with one tenant at
        its cap, three quarters, and silent sockets in the lobby's quarter, every other
        tenant was refused for as long as those sockets were renewed)."""
        try:
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        while True:
            with self.lock:
                refused = self._over_limit()
                room = refused is None and len(self.pending) < self.pending_quota
                if room:
                    waiting = _Waiting(sock, local, time.monotonic() + self.cfg.hello_timeout_s)
                    self.pending[waiting] = None
                    break
                if not self.pending or self.stopping.is_set():
                    break
            self._push_out_oldest(sel)
        if not room:
            self.metrics.connections_refused.inc()
            _say(sock, w.ErrorCode.UNAVAILABLE, refused or "the daemon is shutting down")
            sock.close()
            return
        self.metrics.connections.inc()
        self.metrics.connections_total.inc()
        sel.register(sock, selectors.EVENT_READ, waiting)

    def _push_out_oldest(self, sel: selectors.BaseSelector) -> None:
        """Make room in the lobby: its oldest connection leaves it, with a thread of its
        own if its first frame has come whole meanwhile (read now: a newer connection's
        accept may come before that read), else pushed out."""
        with self.lock:
            oldest = next(iter(self.pending))
        self._read_first(oldest, sel)
        with self.lock:
            if self.pending.pop(oldest, False) is not None:
                return  # it left the lobby (its frame came, or it went)
        self.metrics.connections_refused.inc()
        self._drop(oldest, "too many connections waiting to authenticate: this one, the "
                           "oldest, made room; retry", sel)

    def _read_first(self, waiting: _Waiting, sel: selectors.BaseSelector) -> None:
        """Read what has come of a connection's first frame; once it is whole, the
        connection gets its thread. A prefix that is no kvtier frame, or announces too big
        a header, is answered (ERROR) and closed here."""
        while waiting.got < waiting.need:
            try:
                k = waiting.sock.recv_into(memoryview(waiting.buf)[waiting.got:waiting.need])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                k = 0
            if not k:  # the peer left
                if self._leave_lobby(waiting):
                    self._drop(waiting, None, sel)
                return
            waiting.got += k
            if waiting.got == waiting.need == w.PREFIX.size:
                try:
                    _, _, header_len, _ = w.decode_prefix(bytes(waiting.buf),
                                                          self.cfg.max_payload_bytes,
                                                          w.MAX_HELLO_HEADER_BYTES)
                except w.ProtocolError as e:
                    self.metrics.protocol_errors.inc()
                    if self._leave_lobby(waiting):
                        sel.unregister(waiting.sock)
                        _say(waiting.sock, e.code, str(e))
                        self._drop(waiting, None)
                    return
                waiting.need += header_len
                waiting.buf += bytes(header_len)
        if self._leave_lobby(waiting):
            sel.unregister(waiting.sock)
            self._start(waiting)

    def _start(self, waiting: _Waiting) -> None:
        sock, conn = waiting.sock, None
        try:
            sock.setblocking(True)
            if not waiting.local:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            w.size_buffers(sock)
            w.kernel_timeouts(sock, self.cfg.hello_timeout_s)
            conn = ServedConnection(sock, self, waiting.local, bytes(waiting.buf),
                                    waiting.deadline)
            thread = threading.Thread(target=conn.run, name="kvtier-conn", daemon=True)
            with self.lock:
                self.conns[conn] = thread
            thread.start()
        except Exception as e:  # noqa: BLE001 - no thread to be had (a limit, memory): this
            # connection goes, the lobby stays (it died with it, and accepted no more)
            if not isinstance(e, OSError):
                log.warning("cannot start a connection's thread (%s): closing it", e)
            if conn is not None:
                with self.lock:
                    self.conns.pop(conn, None)
                self.metrics.retire(conn.tally)
            self._drop(waiting, None)  # (its one count in the gauge, from its admission)

    def _leave_lobby(self, waiting: _Waiting) -> bool:
        """Take `waiting` out of the lobby's list; False if it was no longer there."""
        with self.lock:
            return self.pending.pop(waiting, False) is None

    def _expire(self, sel: selectors.BaseSelector) -> None:
        """Close the connections whose first frame did not come whole in time."""
        now = time.monotonic()
        while True:
            with self.lock:
                oldest = next(iter(self.pending), None)
                if oldest is None or oldest.deadline > now:
                    return
                del self.pending[oldest]
            self._drop(oldest, None, sel)

    def _drop(self, waiting: _Waiting, why: str | None,
              sel: selectors.BaseSelector | None = None) -> None:
        """Close a connection of the lobby's (saying `why`, if given: UNAVAILABLE)."""
        if sel is not None:
            try:
                sel.unregister(waiting.sock)
            except (KeyError, ValueError):
                pass
        if why is not None:
            _say(waiting.sock, w.ErrorCode.UNAVAILABLE, why)
        waiting.sock.close()
        self.metrics.connections.dec()

    def _over_limit(self) -> str | None:
        if self.stopping.is_set():
            return "the daemon is shutting down"
        if len(self.conns) + len(self.pending) >= self.cfg.max_connections:
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

    def forget(self, conn: ServedConnection) -> None:
        with self.lock:
            self._uncount_tenant(conn)
            if self.conns.pop(conn, None) is not None:
                self.metrics.connections.dec()

    def shutdown(self, grace_s: float) -> None:
        """Stop accepting; idle connections close now, busy ones after their current op."""
        self.stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._lobby.is_alive() and self._lobby is not threading.current_thread():
            self._lobby.join(timeout=5)  # (it closes the connections still in it)
        for listener in (self.sock, self.local_sock):
            if listener is None:
                continue
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        self._wake_r.close()
        self._wake_w.close()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self.lock:
                conns = list(self.conns.items())
                for conn, _ in conns:
                    conn.wake_if_idle()
            if not conns:
                break
            if conns[0][1].ident is not None:  # (one whose start failed is being dropped)
                conns[0][1].join(timeout=0.05)
            else:
                time.sleep(0.05)
        with self.lock:
            left = len(self.conns)
        if left:
            log.warning("%d connections still busy after %.1fs; closing the stores anyway",
                        left, grace_s)
        if self.drainer is not None:
            self.drainer.close()
