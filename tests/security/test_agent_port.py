"""The transfer-agent port exporting a namespace's DRAM arena: a stranger who finds it gets
nothing (no identifiers, no sizes, no bytes); only a key granted to an authenticated client
of that namespace opens it, and only while that client is connected."""
from __future__ import annotations

import socket

import msgpack
import numpy as np
import pytest

from kvstore import Client
from kvstore.keys import hash_blocks
from transfer import AgentMetadata
from transfer.backends.tcp_wire import HEAD, MAGIC, WIRE_VERSION, Kind, frame

from kvstore import wire as w

from .conftest import ALICE, BOB, block_of, call, hello_msg, raw_conn, wait_for


def agent_reply(addr, hello_fields) -> tuple[int, bytes]:
    """Send a transfer-layer HELLO to the agent port; (reply kind, reply header bytes)."""
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(frame(Kind.HELLO, hello_fields))
        head = s.recv(HEAD.size, socket.MSG_WAITALL)
        if len(head) < HEAD.size:
            return -1, b""
        _, _, kind, _, hlen, _ = HEAD.unpack(head)
        return kind, s.recv(hlen, socket.MSG_WAITALL)


def read_whole_region(addr, agent_id: str, key: bytes, region: int, size: int) -> int:
    """Try a one-sided READ of a region; the reply kind (DATA means bytes came back)."""
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(frame(Kind.HELLO, [agent_id, "thief", key]))
        head = s.recv(HEAD.size, socket.MSG_WAITALL)
        if len(head) < HEAD.size or HEAD.unpack(head)[2] != Kind.ACK:
            return -1
        s.recv(HEAD.unpack(head)[4], socket.MSG_WAITALL)
        q = lambda v: np.array([v], "<i8").tobytes()  # noqa: E731
        s.sendall(frame(Kind.READ, [1, q(region), q(0), q(size), None]))
        head = s.recv(HEAD.size, socket.MSG_WAITALL)
        return HEAD.unpack(head)[2] if len(head) == HEAD.size else -1


@pytest.fixture
def secured(make_daemon, token_file):
    return make_daemon("--token-file", token_file)


def alice_agent(d):
    with raw_conn(d) as s:
        ok = call(s, hello_msg(ALICE, "alice-secret", agent=True)).msg
    return AgentMetadata.decode(ok.agent_meta), ok


def test_a_stranger_learns_nothing_from_the_agent_port(secured):
    meta, ok = alice_agent(secured)
    addr = meta.tcp_addr
    assert addr[0] == "127.0.0.1"  # bound where the daemon binds, loopback here
    for fields in (["0" * 32, "x", b""], [meta.agent_id, "x", b""],
                   [meta.agent_id, "x", b"k" * 32], ["0" * 32, "x", ok.agent_key]):
        kind, body = agent_reply(addr, fields)
        assert kind == Kind.ERROR
        text = msgpack.unpackb(body, raw=False)
        assert text[2] == "refused", text
        assert meta.agent_id.encode() not in body and str(meta.regions[0].size).encode() \
            not in body
    region = meta.regions[0]
    assert read_whole_region(addr, meta.agent_id, b"", region.region_id, region.size) == -1


def test_a_key_opens_only_its_own_namespace_and_only_while_granted(secured):
    alice_meta, _ = alice_agent(secured)
    with raw_conn(secured) as s:  # bob's key is for bob's namespace's agent
        bob_ok = call(s, hello_msg(BOB, "bob-secret", agent=True)).msg
        assert read_whole_region(alice_meta.tcp_addr, alice_meta.agent_id, bob_ok.agent_key,
                                 alice_meta.regions[0].region_id, 16) == -1
    with raw_conn(secured) as s:
        ok = call(s, hello_msg(ALICE, "alice-secret", agent=True)).msg
        region = alice_meta.regions[0].region_id
        assert read_whole_region(alice_meta.tcp_addr, alice_meta.agent_id, ok.agent_key,
                                 region, 16) == Kind.DATA
    # the connection that held the key closed: the key is revoked
    assert wait_for(lambda: read_whole_region(alice_meta.tcp_addr, alice_meta.agent_id,
                                              ok.agent_key, region, 16) == -1)


def test_a_tenant_token_gets_no_agent_of_another_tenant(secured):
    with raw_conn(secured) as s:
        reply = call(s, hello_msg(BOB, "alice-secret", agent=True))
        assert reply.op is w.Op.ERROR and reply.msg.code == w.ErrorCode.FORBIDDEN


def test_the_agent_path_works_for_the_rightful_client(secured):
    hs = hash_blocks(ALICE, np.arange(4 * 16))
    with Client(secured.url, "alice-secret", ALICE, use_shm=False, use_agent=True) as c:
        assert c.transport == "agent"
        c.put_n(hs, np.stack([block_of(h, ALICE.block_bytes) for h in hs]))
        out = np.zeros((4, ALICE.block_bytes), np.uint8)
        assert None not in c.get_n(hs, out)
        assert all(np.array_equal(o, block_of(h, ALICE.block_bytes)) for h, o in zip(hs, out))


def test_the_agent_port_refuses_an_oversized_hello(secured):
    meta, _ = alice_agent(secured)
    with socket.create_connection(meta.tcp_addr, timeout=5) as s:
        s.sendall(HEAD.pack(MAGIC, WIRE_VERSION, Kind.HELLO, 0, 1 << 20, 0))
        head = s.recv(HEAD.size, socket.MSG_WAITALL)
        assert len(head) == HEAD.size and HEAD.unpack(head)[2] == Kind.ERROR


def _admitted(addr, agent_id: str, key: bytes) -> tuple[socket.socket, int]:
    s = socket.create_connection(addr, timeout=5)
    s.sendall(frame(Kind.HELLO, [agent_id, "peer", key]))
    head = s.recv(HEAD.size, socket.MSG_WAITALL)
    if len(head) < HEAD.size:
        return s, -1
    s.recv(HEAD.unpack(head)[4], socket.MSG_WAITALL)
    return s, HEAD.unpack(head)[2]


def test_the_daemons_agent_keeps_no_notifications_and_caps_a_keys_connections(secured):
    """The daemon reads no notification from its agents: a client's NOTIFY is refused
    (4096 of 64 KiB had been kept per namespace, 256 MiB outside every tenant's memory,
    after the client left), and one key opens at most max_conns_per_key connections
    (one client had held 300, a daemon thread each)."""
    from transfer import AgentConfig
    with raw_conn(secured) as data:
        ok = call(data, hello_msg(ALICE, "alice-secret", agent=True)).msg
        meta = AgentMetadata.decode(ok.agent_meta)
        s, kind = _admitted(meta.tcp_addr, meta.agent_id, ok.agent_key)
        assert kind == Kind.ACK
        s.sendall(frame(Kind.NOTIFY, [1, b"n" * 1024]))
        head = s.recv(HEAD.size, socket.MSG_WAITALL)
        assert HEAD.unpack(head)[2] == Kind.ERROR
        s.recv(HEAD.unpack(head)[4], socket.MSG_WAITALL)
        assert s.recv(1) == b""  # closed: its place under the key is free again
        s.close()
        cap = AgentConfig().max_conns_per_key
        held = [_admitted(meta.tcp_addr, meta.agent_id, ok.agent_key) for _ in range(cap)]
        try:
            assert all(kind == Kind.ACK for _, kind in held)
            extra, kind = _admitted(meta.tcp_addr, meta.agent_id, ok.agent_key)
            extra.close()
            assert kind == Kind.ERROR
        finally:
            for s, _ in held:
                s.close()
