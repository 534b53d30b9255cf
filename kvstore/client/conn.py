"""One data-plane connection of the SDK: connect, hello, and blocking request/reply.

Over TCP (`Address`), or, on the daemon's host, over its local Unix socket
(`LocalAddress`, the abstract name HELLO's reply gives), where replies to SHARE and STAGE
carry shared memory as file descriptors."""
from __future__ import annotations

import socket
import time
from typing import NamedTuple
from urllib.parse import urlsplit

import numpy as np

from kvstore import wire as w
from kvstore.client import replies
from kvstore.client.errors import ConnectError, RequestTimeout
from kvstore.keys import Namespace
from transfer.shm import ShmSegment
from transfer.sockio import Spin

DEFAULT_PORT = 7481


class Address(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return w.netloc(self.host, self.port)


class LocalAddress(NamedTuple):
    name: str  # an abstract Unix socket name (without the leading NUL)

    def __str__(self) -> str:
        return "the daemon's local socket"

    def connect(self, timeout_s: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + self.name)
        except OSError:
            sock.close()
            raise
        return sock


def cut(conns) -> None:
    """Shut down connections (anything with a `sock`) another thread or task may be
    waiting on: its call raises at once (a closed client's, say), not after its timeout."""
    for conn in conns:
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def parse_url(url: str) -> Address:
    """'kvtier://HOST:PORT' or 'HOST:PORT' (the daemon's data-plane address)."""
    parts = urlsplit(url if "://" in url else f"kvtier://{url}")
    if parts.scheme != "kvtier" or not parts.hostname:
        pool = (" (a pool's etcd:// address goes to kvstore.connect or ClusterClient)"
                if parts.scheme in ("etcd", "etcds") else "")
        raise ValueError(f"daemon url {url!r} must look like kvtier://HOST:PORT (the data-plane "
                         f"port `kvtier serve` prints; not the http:// control plane){pool}")
    return Address(parts.hostname, parts.port or DEFAULT_PORT)


class Connection:
    def __init__(self, addr: Address | LocalAddress, token: str, ns: Namespace,
                 timeout_s: float, connect_timeout_s: float, want_agent: bool = False,
                 agent_key: bytes = b"", spin_us: float = 0.0) -> None:
        self.addr, self.timeout_s = addr, timeout_s
        self.local = isinstance(addr, LocalAddress)
        self.closed = False
        self.pending_release: list[int] = []
        self._staging: ShmSegment | None = None
        try:
            if self.local:
                self.sock = addr.connect(connect_timeout_s)
            else:
                self.sock = socket.create_connection(addr, timeout=connect_timeout_s)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise ConnectError(f"cannot reach the kvtier daemon at {addr} ({e}); "
                               "is `kvtier serve` running there?") from e
        w.size_buffers(self.sock)
        w.kernel_timeouts(self.sock, timeout_s)
        self.reader = w.FrameReader(self.sock)
        self.reader.spin = Spin(spin_us * 1e-6)
        self.reader.standing = timeout_s
        self._deadline = 0.0  # the current request's (see send)
        hello = replies.hello(ns, token, want_agent, agent_key)
        try:
            self.info: w.HelloOk = self.call(hello)[0]
        except BaseException:
            self.close()
            raise

    def send(self, msg: w.Message, payload=()) -> None:
        """A request and its payload. The request's time starts here: the request goes out
        and its reply's header comes back (`receive`) within timeout_s, however the daemon
        paces its bytes (each call is bounded by the time left, not by the socket's timeout
        alone, which any progress restarted)."""
        self._deadline = deadline = time.monotonic() + self.timeout_s
        changed = True  # (an exception midway may leave the socket's timeout changed)
        try:
            changed = w.send_frame(self.sock, msg, msg.OP, False, payload, deadline,
                                   self.timeout_s)
        except w.TIMED_OUT as e:
            raise RequestTimeout(f"sending {msg.OP.name} to {self.addr} "
                                 f"stalled for {self.timeout_s}s") from e
        finally:
            if changed:
                self._restore_timeout(socket.SO_SNDTIMEO)

    def receive(self, op: w.Op) -> tuple[w.Message, int]:
        """The reply to `op` (its payload, if any, is still to be read); raises RemoteError."""
        reader = self.reader
        reader.reply_deadline = self._deadline
        try:
            frame = reader.frame(1 << 62)
        except w.TIMED_OUT as e:
            raise RequestTimeout(f"no reply to {op.name} from {self.addr} within "
                                 f"{self.timeout_s}s (raise timeout_s for big batches)") from e
        finally:
            reader.reply_deadline = None
            if reader.rebound:
                self._restore_timeout(socket.SO_RCVTIMEO)
        return replies.check_reply(frame, op)

    def call(self, msg: w.Message, payload=()) -> tuple[w.Message, int]:
        self.send(msg, payload)
        return self.receive(msg.OP)

    def recv_into(self, view: memoryview) -> None:
        """Payload bytes of the last reply, within timeout_s a call."""
        reader = self.reader
        reader.payload_deadline = time.monotonic() + self.timeout_s
        try:
            reader.recv_into(view)
        except w.TIMED_OUT as e:
            raise RequestTimeout(f"payload from {self.addr} stalled for "
                                 f"{self.timeout_s}s") from e
        finally:
            if reader.rebound:
                self._restore_timeout(socket.SO_RCVTIMEO)

    def _restore_timeout(self, option: int) -> None:
        """The socket's standing send or receive timeout back, after a deadline's."""
        if option == socket.SO_RCVTIMEO:
            self.reader.rebound = False
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, option, w.timeval(self.timeout_s))
        except OSError:
            pass  # closed under us: the error that ended the call says why

    def flush_releases(self) -> None:
        if self.pending_release:
            ids, self.pending_release = tuple(self.pending_release), []
            self.call(w.Release(lease_ids=ids))

    def call_fds(self, msg: w.Message, num_fds: int) -> tuple[w.Message, list[int]]:
        """A request whose reply carries `num_fds` descriptors (local socket only); the
        caller owns them."""
        self.send(msg)
        try:
            frame, fds = self.reader.frame_with_fds(0)
        except w.TIMED_OUT as e:
            raise RequestTimeout(f"no reply to {msg.OP.name} within {self.timeout_s}s") from e
        return replies.check_fds(frame, msg.OP, fds, num_fds), fds

    def staging(self, nbytes: int) -> np.ndarray:
        """This connection's staging segment (same host only), at least nbytes long: the
        daemon creates it on the first STAGE and regrows it on request."""
        if self._staging is None or self._staging.size < nbytes:
            reply, (fd,) = self.call_fds(w.Stage(nbytes=nbytes), 1)
            self._drop_staging()
            self._staging = ShmSegment.from_fd(fd, writable=True, size=reply.nbytes)
        return self._staging.array

    def _drop_staging(self) -> None:
        if self._staging is not None:
            self._staging, segment = None, self._staging
            segment.close()

    def close(self) -> None:
        self.closed = True
        self._drop_staging()
        self.sock.close()
