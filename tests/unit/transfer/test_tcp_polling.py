"""The tcp backend polls its socket before it sleeps in a receive (AgentConfig.spin_us): for
an admitted peer's next request on the serving side, for the reply to its own request on
the requesting side. A connection that has not been admitted never polls (a stranger gets
no CPU for nothing), and spin_us 0 never polls at all."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from transfer import Agent, AgentConfig, AgentMetadata, BackendKind, DescList, Op, sockio
from transfer.backends.tcp_wire import HEAD, Kind, frame

pytestmark = pytest.mark.skipif(sockio.spin_recv is None,
                                reason="transfer._stream is not built (no C compiler)")


@pytest.fixture
def polls(monkeypatch) -> list[int]:
    """The descriptors every poll of this test is made on, in order: by this thread or one
    started since (a serving thread of an earlier test's agent, closed but not yet gone,
    polled once more during the next test: seen once in CI)."""
    calls: list[int] = []
    real = sockio.spin_recv
    earlier = [t for t in threading.enumerate() if t is not threading.current_thread()]
    monkeypatch.setattr(sockio, "waited_for_cpu", lambda: False)  # polls on a busy host too
    monkeypatch.setattr(sockio, "oversubscribed", lambda: False)

    def recording(fd, view, window_ns):
        if not any(t is threading.current_thread() for t in earlier):
            calls.append(fd)
        return real(fd, view, window_ns)
    monkeypatch.setattr(sockio, "spin_recv", recording)
    return calls


def _agents(spin_us: float):
    config = dict(backends=(BackendKind.TCP,), io_timeout_s=2.0, connect_timeout_s=2.0,
                  spin_us=spin_us)
    target = Agent("target", AgentConfig(require_grant=True, **config))
    client = Agent("client", AgentConfig(**config))
    return target, client


def _round_trips(target: Agent, client: Agent) -> None:
    """A READ and a WRITE of a granted peer, checked byte for byte."""
    mem = np.zeros(1 << 16, np.uint8)
    src = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    region = target.register(mem)
    target.grant(b"k" * 32)
    client.add_peer(target.metadata(), key=b"k" * 32)
    local = client.prepare(DescList.uniform(client.register(src), 4096, 16))
    remote = client.prepare(DescList.uniform(region.region_id, 4096, 16), peer="target")
    client.transfer(Op.WRITE, local, None, remote, None, 5)
    assert np.array_equal(mem, src)
    back = np.zeros_like(src)
    client.transfer(Op.READ, client.prepare(DescList.uniform(client.register(back), 4096, 16)),
                    None, remote, None, 5)
    assert np.array_equal(back, src)


def _stranger(target: Agent) -> None:
    """A raw connection whose HELLO trickles in, then carries a key never granted."""
    addr = AgentMetadata.decode(target.metadata()).tcp_addr
    with socket.create_connection(addr, timeout=3) as s:
        hello = frame(Kind.HELLO, [target.agent_id, "stranger", b"x" * 32])
        s.sendall(hello[:3])
        s.sendall(hello[3:])
        head = s.recv(HEAD.size, socket.MSG_WAITALL)
        assert HEAD.unpack(head)[2] == Kind.ERROR
        assert s.recv(HEAD.unpack(head)[4], socket.MSG_WAITALL)  # the refusal's header
        assert s.recv(1) == b""  # and the connection is closed


def test_admitted_peers_poll_on_both_sides_and_strangers_never(polls):
    target, client = _agents(spin_us=100)
    try:
        _stranger(target)
        assert polls == []  # nothing polled for a connection never admitted
        _round_trips(target, client)
        # the requester's socket (its replies) and the server's (each next request)
        assert len(set(polls)) >= 2, polls
    finally:
        client.close()
        target.close()


def test_spin_us_zero_never_polls(polls):
    target, client = _agents(spin_us=0)
    try:
        _round_trips(target, client)
        assert polls == []
    finally:
        client.close()
        target.close()


def test_spin_us_is_checked():
    with pytest.raises(ValueError, match="spin_us"):
        AgentConfig(spin_us=-1)
