"""Bad input and faults against a real daemon: each refused clearly, only that connection
closed, and the daemon keeps serving everyone else."""
from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvstore import Client
from kvstore import wire as w
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks
from kvstore.store import PutStatus

from .conftest import NS, block_of

BB = NS.block_bytes


def raw_conn(daemon) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", daemon.port), timeout=5)
    return s


def hello(s: socket.socket, ns=NS, token: str = "") -> w.Message:
    msg = w.Hello(token=token, model=ns.model, num_layers=ns.num_layers,
                  num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim, dtype=ns.dtype,
                  block_tokens=ns.block_tokens, revision=ns.revision, tenant=ns.tenant)
    w.send_frame(s, msg, w.Op.HELLO, False)
    return w.recv_frame(s, 1 << 30).msg


def expect_error_then_close(s: socket.socket, code: w.ErrorCode) -> str:
    frame = w.recv_frame(s, 1 << 30)
    assert frame.op is w.Op.ERROR and frame.msg.code == code, frame.msg
    try:  # the daemon closed this connection (a reset when our junk was left unread)
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass
    return frame.msg.message


def still_serving(daemon) -> None:
    with Client(daemon.url, namespace=NS, use_shm=False) as c:
        h = hash_blocks(NS, np.arange(16) + int(time.time_ns() % 10**9))[0]
        c.put(h, block_of(h, BB))
        assert c.get(h) == block_of(h, BB).tobytes()


def test_malformed_frame(daemon):
    with raw_conn(daemon) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert "magic" in expect_error_then_close(s, w.ErrorCode.PROTOCOL)
    with raw_conn(daemon) as s:  # right prefix, header not msgpack of the right shape
        s.sendall(w.PREFIX.pack(w.MAGIC, w.PROTOCOL_VERSION, w.Op.HELLO, 3, 0) + b"\xc1\xc1\xc1")
        expect_error_then_close(s, w.ErrorCode.PROTOCOL)
    still_serving(daemon)


def test_wrong_protocol_version(daemon):
    with raw_conn(daemon) as s:
        s.sendall(w.PREFIX.pack(w.MAGIC, 99, w.Op.HELLO, 0, 0))
        assert "version 99" in expect_error_then_close(s, w.ErrorCode.VERSION)
    still_serving(daemon)


def test_oversized_length_fields(daemon):
    for header_len, payload_len in ((w.MAX_HEADER_BYTES + 1, 0), (10, 1 << 40)):
        with raw_conn(daemon) as s:
            s.sendall(w.PREFIX.pack(w.MAGIC, w.PROTOCOL_VERSION, w.Op.PUT, header_len, payload_len))
            expect_error_then_close(s, w.ErrorCode.TOO_LARGE)
    still_serving(daemon)


def test_op_before_hello_and_unknown_op(daemon):
    with raw_conn(daemon) as s:
        w.send_frame(s, w.Stats(), w.Op.STATS, False)
        assert "HELLO" in expect_error_then_close(s, w.ErrorCode.PROTOCOL)
    with raw_conn(daemon) as s:
        s.sendall(w.PREFIX.pack(w.MAGIC, w.PROTOCOL_VERSION, 4242, 1, 0) + msgpack.packb([]))
        expect_error_then_close(s, w.ErrorCode.PROTOCOL)


def test_wrong_block_size_keeps_connection(daemon):
    with raw_conn(daemon) as s:
        assert isinstance(hello(s), w.HelloOk)
        h = hash_blocks(NS, np.arange(16) + 5)[0]
        w.send_frame(s, w.Put(hashes=h), w.Op.PUT, False, [b"\x01" * (BB - 1)])
        frame = w.recv_frame(s, 1 << 30)
        assert frame.msg.code == w.ErrorCode.BLOCK_SIZE and str(BB) in frame.msg.message
        w.send_frame(s, w.Exists(hashes=h), w.Op.EXISTS, False)  # same connection still works
        assert w.recv_frame(s, 1 << 30).msg.flags == b"\x00"


def test_bad_namespace_refused(daemon):
    with raw_conn(daemon) as s:
        w.send_frame(s, w.Hello(model="", num_layers=0), w.Op.HELLO, False)
        frame = w.recv_frame(s, 1 << 30)
        assert frame.msg.code == w.ErrorCode.NAMESPACE and "model" in frame.msg.message


def test_disconnect_mid_put_leaves_nothing(daemon):
    hs = hash_blocks(NS, np.arange(4 * 16) + 777)
    with raw_conn(daemon) as s:  # TCP put: header + a block and a bit, then gone
        hello(s)
        s.sendall(w.encode(w.Put(hashes=w.pack_hashes(hs)), w.Op.PUT, False, 4 * BB))
        s.sendall(b"\x01" * (BB + 100))
    with Client(daemon.url, namespace=NS) as c:  # the daemon notices the cut connection
        deadline = time.monotonic() + 10
        while c.stats().open_reservations and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats().open_reservations == 0 and c.contains_n(hs) == [False] * 4
    with raw_conn(daemon) as s:  # shm-style put: reserve, then the client dies before commit
        hello(s)
        w.send_frame(s, w.Reserve(hashes=w.pack_hashes(hs)), w.Op.RESERVE, False)
        assert w.recv_frame(s, 1 << 30).msg.statuses == b"\x00" * 4
    with Client(daemon.url, namespace=NS) as c:
        deadline = time.monotonic() + 10
        while c.stats().open_reservations and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats().open_reservations == 0
        assert c.contains_n(hs) == [False] * 4  # nothing half-written became visible
        assert c.put_n(hs, [block_of(h, BB) for h in hs]) == [PutStatus.STORED] * 4


@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "same-host"])
def test_a_put_of_a_block_another_connections_put_has_reserved_is_stored(daemon, use_shm):
    """Another client's PUT of the same block is still coming (its slots reserved) and never
    completes: the daemon answered EXISTS to every other put of that block meanwhile, and
    once the first connection was cut nobody had stored it. Now the other put stores it
    (over TCP, or copied by a same-host client into a granted slot), whatever becomes of
    the first."""
    hs = hash_blocks(NS, np.arange(4 * 16) + (52525 if use_shm else 53535))  # (one daemon)
    data = [block_of(h, BB) for h in hs]
    with raw_conn(daemon) as s:  # A: header + a block and a bit, then it waits, then gone
        hello(s)
        s.sendall(w.encode(w.Put(hashes=w.pack_hashes(hs)), w.Op.PUT, False, 4 * BB))
        s.sendall(data[0].tobytes() + b"\x01" * 100)
        with Client(daemon.url, namespace=NS, use_shm=use_shm) as b:
            deadline = time.monotonic() + 10
            while not b.stats().open_reservations and time.monotonic() < deadline:
                time.sleep(0.01)  # (A's slots are reserved once its header is read)
            assert b.stats().open_reservations == 1
            assert b.put_n(hs[1:3], data[1:3]) == [PutStatus.STORED] * 2
            assert b.uses_shm is use_shm
            assert _blocks_are(b, hs[1:3])
    with Client(daemon.url, namespace=NS) as c:  # A's connection is gone: aborted
        deadline = time.monotonic() + 10
        while c.stats().open_reservations and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats().open_reservations == 0
        assert c.contains_n(hs) == [False, True, True, False] and _blocks_are(c, hs[1:3])
        assert c.put_n(hs, data) == [PutStatus.STORED, PutStatus.EXISTS, PutStatus.EXISTS,
                                     PutStatus.STORED]


def _call(s: socket.socket, msg: w.Message, payload=()) -> w.Frame:
    w.send_frame(s, msg, msg.OP, False, payload)
    return w.recv_frame(s, 1 << 30)


def _blocks_are(c: Client, hs: list[bytes]) -> bool:
    out = np.empty((len(hs), BB), np.uint8)
    return None not in c.get_n(hs, out) and all((row == block_of(h, BB)).all()
                                                for row, h in zip(out, hs))


def test_a_put_slower_than_the_reservation_timeout_corrupts_no_other_block(daemon):
    """A TCP PUT whose payload takes longer than --reservation-timeout (1 s here) keeps its
    slots until it ends. Reclaimed midway (as it was), its slots went to the next put while
    its bytes still arrived: another client's block was silently overwritten."""
    slow = hash_blocks(NS, np.arange(2 * 16) + 4242)
    payload = np.concatenate([block_of(h, BB) for h in slow])
    others = hash_blocks(NS, np.arange(8 * 16) + 9191)
    with raw_conn(daemon) as s:
        hello(s)
        s.sendall(w.encode(w.Put(hashes=w.pack_hashes(slow)), w.Op.PUT, False, payload.nbytes))
        s.sendall(payload[:BB + 100].tobytes())
        time.sleep(1.6)  # past the timeout (the daemon's maintenance runs every 0.5 s), not
        # past the payload's deadline (twice the timeout, plus 4 MiB/s)
        with Client(daemon.url, namespace=NS, use_shm=False) as c:
            assert c.put_n(others, [block_of(h, BB) for h in others]) == [PutStatus.STORED] * 8
        s.sendall(payload[BB + 100:].tobytes())
        reply = w.recv_frame(s, 1 << 30)
        assert reply.op is w.Op.PUT and reply.msg.statuses == b"\x00" * 2, reply.msg
    with Client(daemon.url, namespace=NS, use_shm=False) as c:
        assert _blocks_are(c, others) and _blocks_are(c, slow)
        c.remove_n(others + slow)


def metric(daemon, name: str, *labels: str) -> float:
    """The sum of a Prometheus metric's samples (those with every one of `labels`)."""
    text = urllib.request.urlopen(daemon.http + "/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(label in line for label in labels))


def internal_errors(daemon) -> float:
    return metric(daemon, "kvtier_internal_errors_total")


def test_a_put_that_trickles_past_its_deadline_is_aborted_and_holds_nothing(daemon):
    """A payload must keep up 4 MiB/s after twice --reservation-timeout (2 s here): one
    sending a byte per idle timeout held its slots for as long as it liked. Past the
    deadline the put is aborted, nothing of it stored, the connection closed. The client
    was at fault, not the daemon: no internal error is counted (operators page on it)."""
    errors = internal_errors(daemon)
    slow = hash_blocks(NS, np.arange(2 * 16) + 8383)
    payload = np.concatenate([block_of(h, BB) for h in slow])
    with raw_conn(daemon) as s:
        hello(s)
        s.sendall(w.encode(w.Put(hashes=w.pack_hashes(slow)), w.Op.PUT, False, payload.nbytes))
        s.sendall(payload[:100].tobytes())
        time.sleep(2.5)
        try:
            s.sendall(payload[100:].tobytes())
            assert s.recv(1) == b""  # closed, no reply
        except (ConnectionResetError, BrokenPipeError):
            pass
    with Client(daemon.url, namespace=NS, use_shm=False) as c:
        deadline = time.monotonic() + 10
        while c.stats().open_reservations and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.contains_n(slow) == [False, False] and c.stats().open_reservations == 0
    assert internal_errors(daemon) == errors


def test_a_client_that_never_reads_its_replies_is_no_internal_error(daemon):
    """GETs pipelined by a client that reads nothing: the daemon's sends time out, the
    connection ends, and that is the client's doing (it was counted an internal error,
    with a traceback in the log)."""
    errors = internal_errors(daemon)
    hs = hash_blocks(NS, np.arange(64 * 16) + 9494)
    with Client(daemon.url, namespace=NS, use_shm=False) as c:
        c.put_n(hs, np.concatenate([block_of(h, BB) for h in hs]))
    ended = ('op="get"', 'outcome="disconnected"'), ('op="get"', 'outcome="internal"')
    before = sum(metric(daemon, "kvtier_ops_total", *labels) for labels in ended)
    with raw_conn(daemon) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        hello(s)
        s.sendall(w.encode(w.Get(hashes=w.pack_hashes(hs)), w.Op.GET, False) * 64)
        deadline = time.monotonic() + 60  # until the daemon gives up on this connection
        while (sum(metric(daemon, "kvtier_ops_total", *labels) for labels in ended) == before
               and time.monotonic() < deadline):
            time.sleep(0.2)
        assert time.monotonic() < deadline, "the daemon never gave up sending"
    assert internal_errors(daemon) == errors
    still_serving(daemon)


def test_a_timed_out_reservation_keeps_its_dram_slots_until_the_client_is_done(daemon):
    """A same-host writer fills its reserved DRAM slots itself, and may still be at it when
    the timeout reclaims the reservation: those slots are not handed out again until it
    sends COMMIT (refused: nothing stored) or ABORT, or its connection ends."""
    hs = hash_blocks(NS, np.arange(16) + 5151)
    more = hash_blocks(NS, np.arange(4 * 16) + 6161)
    with local_conn(daemon) as s, raw_conn(daemon) as other:  # s: a same-host writer
        hello(s)
        hello(other)
        r = _call(s, w.Reserve(hashes=w.pack_hashes(hs)))
        rid, (slot,) = r.msg.reservation_id, np.frombuffer(r.msg.slots, "<i8")
        assert slot >= 0  # a DRAM slot, for the client to write
        deadline = time.monotonic() + 10
        while _call(s, w.Stats()).msg.open_reservations and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _call(s, w.Stats()).msg.open_reservations == 0  # reclaimed
        taken = _call(other, w.Reserve(hashes=w.pack_hashes(more))).msg
        assert slot not in np.frombuffer(taken.slots, "<i8")  # (slots are reused last-in first)
        assert _call(other, w.Abort(reservation_id=taken.reservation_id)).op is w.Op.ABORT
        late = _call(s, w.Commit(reservation_id=rid))
        assert late.op is w.Op.ERROR and late.msg.code == w.ErrorCode.RESERVATION
        assert "nothing was stored" in late.msg.message or "not open" in late.msg.message
        again = _call(other, w.Reserve(hashes=w.pack_hashes(more))).msg
        assert slot in np.frombuffer(again.slots, "<i8")  # back in use once s was done
        assert _call(other, w.Abort(reservation_id=again.reservation_id)).op is w.Op.ABORT
        assert _call(s, w.Reserve(hashes=w.pack_hashes(hs))).op is w.Op.RESERVE
    still_serving(daemon)  # (and s's connection closed with a reservation open: given back)


def _reserve_each_until_reclaimed(s: socket.socket, hashes: list[bytes]) -> None:
    """RESERVE each hash on `s`, then wait until the store has reclaimed them all."""
    for h in hashes:
        assert _call(s, w.Reserve(hashes=h)).op is w.Op.RESERVE
    deadline = time.monotonic() + 10
    while _call(s, w.Stats()).msg.open_reservations and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _call(s, w.Stats()).msg.open_reservations == 0


def test_timed_out_reservations_cannot_pile_up_out_of_use(daemon):
    """The slots a connection's timed-out reservations keep out of use count against its
    limits (64 reservations) like open ones, for as long as it lives without saying it is
    done (they had gone back after one more timeout: a writer stalled that long wrote into
    another block), and go back when it ends. A TCP client writes no slot itself: its
    timed-out reservations free theirs at once."""
    from kvstore.daemon.session import MAX_OPEN_RESERVATIONS
    hs = hash_blocks(NS, np.arange(16 * (MAX_OPEN_RESERVATIONS + 1)) + 7171)
    with local_conn(daemon) as s:
        hello(s)
        _reserve_each_until_reclaimed(s, hs[:MAX_OPEN_RESERVATIONS])
        refused = _call(s, w.Reserve(hashes=hs[-1]))  # timed out, their slots still kept
        assert refused.op is w.Op.ERROR and refused.msg.code == w.ErrorCode.QUOTA
        time.sleep(2.5)  # two more timeouts (1 s here): still kept
        refused = _call(s, w.Reserve(hashes=hs[-1]))
        assert refused.op is w.Op.ERROR and refused.msg.code == w.ErrorCode.QUOTA
    with local_conn(daemon) as s:  # the first one ended: what it kept went back with it
        hello(s)
        _reserve_each_until_reclaimed(s, hs[:MAX_OPEN_RESERVATIONS])
    with raw_conn(daemon) as t:  # over TCP: no quarantine, nothing held after the timeout
        hello(t)
        _reserve_each_until_reclaimed(t, hs[:MAX_OPEN_RESERVATIONS])
        assert _call(t, w.Reserve(hashes=hs[-1])).op is w.Op.RESERVE
    still_serving(daemon)


@pytest.mark.parametrize("stall", ["within", "past"])
def test_a_leased_copy_finished_after_the_lease_could_end_is_a_miss(make_daemon, monkeypatch,
                                                                    stall):
    """A GET leases DRAM slots for the client to copy; the daemon reuses them once the lease
    TTL passes. A client stalled past it (a pause, SIGSTOP, a busy host) had copied another
    block's bytes and handed them over as a hit: such a copy is a miss now. (The leased
    path: direct reads off, as on a host whose CPU orders memory unlike x86-64.)"""
    import threading

    from kvstore.client import shm, sync
    monkeypatch.setattr(shm, "DIRECT_READS", False)
    d = make_daemon("--lease-ttl", "1", "--dram-size", "16KiB", "--ssd-size", "0")
    real, stalled = sync.copy_row, threading.Event()

    def slow(dst, src):
        if not stalled.is_set():
            stalled.set()
            time.sleep(2.5 if stall == "past" else 0.2)
        return real(dst, src)
    monkeypatch.setattr(sync, "copy_row", slow)
    a, others = hash_blocks(NS, np.arange(16) + 9191), hash_blocks(NS, np.arange(4 * 16) + 9292)
    with Client(d.url, namespace=NS) as reader, Client(d.url, namespace=NS,
                                                       use_shm=False) as writer:
        assert reader.transport == "shm"
        writer.put_n(a, [block_of(a[0], BB)])

        def churn():  # once the lease is over: A gone, its slot taken by other blocks
            time.sleep(1.8)
            writer.remove_n(a)
            for h in others:
                writer.put_n([h], [block_of(h, BB)])
        t = threading.Thread(target=churn)
        t.start()
        out = np.zeros((1, BB), np.uint8)
        tiers = reader.get_n(a, out)
        t.join()
        assert stalled.is_set()
        if stall == "within":
            assert tiers == [TierKind.DRAM] and (out[0] == block_of(a[0], BB)).all()
        else:
            assert tiers == [None]


def test_full_store_reports_no_space(make_daemon):
    d = make_daemon("--dram-size", "16KiB", "--ssd-size", "0")  # 4 slots, DRAM only
    with Client(d.url, namespace=NS) as c:
        hs = hash_blocks(NS, np.arange(6 * 16))
        assert c.put_n(hs[:4], [block_of(h, BB) for h in hs[:4]]) == [PutStatus.STORED] * 4
        assert c.pin_n(hs[:4]) == [True] * 4
        assert c.put_n(hs[4:], [block_of(h, BB) for h in hs[4:]]) == [PutStatus.NO_SPACE] * 2
        c.unpin_n(hs[:4])
        assert c.put_n(hs[4:], [block_of(h, BB) for h in hs[4:]]) == [PutStatus.STORED] * 2


def test_auth_token_and_tenant_isolation(make_daemon, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("admin-secret\nalice-secret alice\nbob-secret bob\n")
    d = make_daemon("--token-file", str(tokens))
    alice = Namespace(NS.model, 1, 1, 64, tenant="alice")
    bob = Namespace(NS.model, 1, 1, 64, tenant="bob")
    for token in ("", "wrong"):
        with pytest.raises(w.AuthError):
            Client(d.url, token=token, namespace=alice)
    with pytest.raises(w.AuthError, match="tenant"):
        Client(d.url, token="alice-secret", namespace=bob)
    with Client(d.url, token="alice-secret", namespace=alice) as a, \
            Client(d.url, token="bob-secret", namespace=bob) as b:
        hs = hash_blocks(NS, np.arange(32))  # same raw hashes in both namespaces
        a.put_n(hs, [block_of(h, BB) for h in hs])
        assert b.contains_n(hs) == [False, False] and b.get(hs[0]) is None
        assert b.remove_n(hs) == 0 and a.contains_n(hs) == [True, True]
    import urllib.error
    with pytest.raises(urllib.error.HTTPError) as e:
        d.get_json("/stats")
    assert e.value.code == 401
    seen = d.get_json("/admin/namespaces", token="bob-secret")["namespaces"]
    assert {n["tenant"] for n in seen} == {"bob"}
    assert len(d.get_json("/admin/namespaces", token="admin-secret")["namespaces"]) == 2


def test_non_loopback_bind_without_token_refused(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "kvstore.daemon", "--host", "0.0.0.0",
                        "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "token" in r.stderr


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(min_size=1, max_size=200))
def test_fuzzed_bytes_close_only_that_connection(daemon, junk):
    with raw_conn(daemon) as s:
        s.settimeout(5)
        try:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):  # an error frame (or nothing), then the daemon closes
                pass
        except OSError:  # reset / not connected: the daemon already closed it
            pass
    with raw_conn(daemon) as s:  # and it still serves the next client
        assert isinstance(hello(s), w.HelloOk)


def local_conn(daemon) -> socket.socket:
    """A raw connection to the daemon's local (Unix) socket, as HELLO over TCP names it."""
    with raw_conn(daemon) as s:
        name = hello(s).local_socket
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    u.settimeout(5)
    u.connect("\0" + name)
    return u


def daemon_maps(daemon, label: str) -> int:
    """How many mappings of anonymous memory `label` the daemon process holds."""
    with open(f"/proc/{daemon.proc.pid}/maps") as f:
        return sum(f"memfd:{label}" in line for line in f)


def test_staged_put_misuse_is_refused_and_the_segment_goes_with_the_connection(daemon):
    import os
    h = hash_blocks(NS, np.arange(16))
    with raw_conn(daemon) as s:  # over TCP there is no shared memory to hand out
        hello(s)
        w.send_frame(s, w.Stage(nbytes=BB), w.Op.STAGE, False)
        frame = w.recv_frame(s, 1 << 30)
        assert frame.op is w.Op.ERROR and "local socket" in frame.msg.message
    before = daemon_maps(daemon, "kvtier-stage")
    with local_conn(daemon) as s:
        hello(s)
        w.send_frame(s, w.Put(hashes=h[0], staged=True), w.Op.PUT, False)
        frame = w.recv_frame(s, 1 << 30)
        assert frame.op is w.Op.ERROR and "send STAGE first" in frame.msg.message
        w.send_frame(s, w.Stage(nbytes=1 << 40), w.Op.STAGE, False)
        assert w.recv_frame(s, 1 << 30).op is w.Op.ERROR
        w.send_frame(s, w.Stage(nbytes=BB), w.Op.STAGE, False)
        frame, fds = w.FrameReader(s).frame_with_fds(0)
        assert frame.op is w.Op.STAGE and len(fds) == 1
        assert os.fstat(fds[0]).st_size == BB and daemon_maps(daemon, "kvtier-stage") == before + 1
        w.close_fds(fds)
        two = hash_blocks(NS, np.arange(32) + 5)
        w.send_frame(s, w.Put(hashes=w.pack_hashes(two), staged=True), w.Op.PUT, False)
        assert "needs a staging segment" in w.recv_frame(s, 1 << 30).msg.message
        w.send_frame(s, w.Exists(hashes=h[0]), w.Op.EXISTS, False)  # still serving
        assert w.recv_frame(s, 1 << 30).msg.flags == b"\x00"
    for _ in range(50):
        if daemon_maps(daemon, "kvtier-stage") == before:
            break
        time.sleep(0.05)
    assert daemon_maps(daemon, "kvtier-stage") == before, "the segment outlived its connection"


def test_staged_puts_reach_ssd_when_dram_is_pinned_full(make_daemon):
    d = make_daemon("--dram-size", "16KiB")  # 4 DRAM slots
    with Client(d.url, namespace=NS) as c:
        assert c.uses_shm and c.staged_put_bytes >= 8 * BB
        first = hash_blocks(NS, np.arange(4 * 16) + 77)
        c.put_n(first, np.stack([block_of(h, BB) for h in first]))
        assert c.pin_n(first) == [True] * 4
        more = hash_blocks(NS, np.arange(8 * 16) + 10**5)
        assert c.put_n(more, np.stack([block_of(h, BB) for h in more])) == \
            [PutStatus.STORED] * 8
        assert c.match_prefix(more).tiers == (TierKind.SSD,) * 8
        out = np.zeros((8, BB), np.uint8)
        assert None not in c.get_n(more, out)
        assert all(np.array_equal(o, block_of(h, BB)) for h, o in zip(more, out))


def test_a_killed_daemon_leaves_nothing_in_dev_shm(make_daemon):
    import os
    before = set(os.listdir("/dev/shm"))
    d = make_daemon()
    with Client(d.url, namespace=NS) as c:
        hs = hash_blocks(NS, np.arange(16) + 4242)
        c.put_n(hs, np.stack([block_of(h, BB) for h in hs]))  # staged: makes a segment
        assert c.uses_shm and set(os.listdir("/dev/shm")) <= before
        d.kill()
    assert set(os.listdir("/dev/shm")) <= before
    d.start()


def test_a_get_whose_reply_would_exceed_the_payload_limit_is_refused(make_daemon, tmp_path):
    """A GET names its blocks, duplicates included: one naming the same stored block many
    times once made the daemon gather (and keep, per connection) a reply of any size. It
    is bounded like a put's payload, and the connection goes on."""
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(f"[serve]\nmax_payload_bytes = {16 * BB}\n")
    d = make_daemon("--config", str(cfg))
    h = hash_blocks(NS, np.arange(16) + 7)[0]
    with raw_conn(d) as s:
        assert isinstance(hello(s), w.HelloOk)
        w.send_frame(s, w.Put(hashes=h), w.Op.PUT, False, [block_of(h, BB)])
        assert isinstance(w.recv_frame(s, 1 << 30).msg, w.PutOk)
        w.send_frame(s, w.Get(hashes=h * 17), w.Op.GET, False)
        frame = w.recv_frame(s, 1 << 30)
        assert frame.op is w.Op.ERROR and frame.msg.code == w.ErrorCode.TOO_LARGE, frame.msg
        assert "split the batch" in frame.msg.message
        w.send_frame(s, w.Get(hashes=h * 16), w.Op.GET, False)  # at the limit: served
        frame = w.recv_frame(s, 1 << 30)
        assert frame.msg.tiers == bytes([TierKind.DRAM]) * 16 and frame.payload_bytes == 16 * BB
        out = bytearray(frame.payload_bytes)
        w.recv_exact(s, memoryview(out))
        assert bytes(out) == block_of(h, BB).tobytes() * 16


def test_a_failed_abort_does_not_hide_why_a_put_failed(make_daemon, monkeypatch):
    """A same-host put whose copy into its reserved slots fails sends ABORT; when that
    fails too (the daemon stopped answering), the put raises its own error, not the
    ABORT's timeout, and the connection is not used again (the next call, once the daemon
    is back, works)."""
    import os
    import signal
    import kvstore.client.sync as sync

    d = make_daemon()
    hs = hash_blocks(NS, np.arange(4 * 16) + 7373)
    blocks = np.concatenate([block_of(h, BB) for h in hs])
    with Client(d.url, namespace=NS, timeout_s=1, staged_put_bytes=0,
                direct_puts=False) as c:
        c.put_n(hs[:1], blocks[:BB])  # connected, the arena mapped

        def copy_fails(dst, src):
            os.kill(d.pid, signal.SIGSTOP)  # the ABORT that follows gets no reply
            raise RuntimeError("the caller's buffer went away")

        monkeypatch.setattr(sync, "copy_row", copy_fails)
        try:
            with pytest.raises(RuntimeError, match="went away"):
                c.put_n(hs[1:], blocks[BB:])
        finally:
            os.kill(d.pid, signal.SIGCONT)
        monkeypatch.undo()
        assert c.put_n(hs[1:], blocks[BB:]) == [PutStatus.STORED] * 3
        assert c.get(hs[2]) == block_of(hs[2], BB).tobytes()


def test_clearing_a_namespace_under_load_waits_for_its_requests(make_daemon):
    """POST .../clear while clients put and get (same host and TCP): the clear waits for
    the requests running on the store, later ones answer UNAVAILABLE, and no request
    touches a closed store or its unmapped arena. It closed them under running requests:
    GET replies sent from unmapped memory (EFAULT), views of a released arena, internal
    errors and put-channel tracebacks by the dozen."""
    import threading
    d = make_daemon(dram_size="2MiB", ssd_size="16MiB")
    stop, wrong, failures = threading.Event(), [], []

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        while not stop.is_set():
            try:
                with Client(d.url, namespace=NS, use_shm=k % 2 == 0, timeout_s=5) as c:
                    while not stop.is_set():
                        hs = hash_blocks(NS, rng.integers(0, 1 << 30, 16 * 32))
                        c.put_n(hs, np.stack([block_of(h, BB) for h in hs]))
                        out = np.zeros((len(hs), BB), np.uint8)
                        for h, row, t in zip(hs, out, c.get_n(hs, out)):
                            if t is not None and not np.array_equal(row, block_of(h, BB)):
                                wrong.append(h)
            except Exception as e:  # noqa: BLE001 - UNAVAILABLE while clearing, reconnects
                failures.append(type(e).__name__)
                time.sleep(0.01)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    url = f"{d.http}/admin/namespaces/{NS.ns_id:016x}/clear"
    for _ in range(15):
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30)
        except urllib.error.HTTPError as e:
            assert e.code == 404, e  # (cleared already, not reopened yet)
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(30)
    assert not wrong
    assert internal_errors(d) == 0
    assert "Traceback" not in d.output()
    still_serving(d)


def test_a_connection_that_ends_after_its_namespace_was_cleared_leaves_nothing_open(make_daemon):
    """A same-host client with a put channel (its shared ring and doorbell) whose namespace
    is cleared, then closes: the connection's own descriptors go, with no error. (Its
    clean-up now leaves the store the clear is closing alone; before, it drained the
    channel and gave its grants back to that store, safe only while the store's close
    raised StoreClosedError cleanly at whatever point it had reached.)"""
    import os
    d = make_daemon(dram_size="2MiB", ssd_size="0")

    def fds() -> int:
        return len(os.listdir(f"/proc/{d.pid}/fd"))

    hs = hash_blocks(NS, np.arange(16 * 4))
    with Client(d.url, namespace=NS) as warm:  # the namespace, its arena and agent, opened
        warm.put_n(hs[:1], block_of(hs[0], BB)[None])
    time.sleep(0.5)
    before = fds()
    c = Client(d.url, namespace=NS)
    c.put_n(hs, np.stack([block_of(h, BB) for h in hs]))  # by the put channel
    assert fds() > before
    url = f"{d.http}/admin/namespaces/{NS.ns_id:016x}/clear"
    urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30)
    c.close()
    deadline = time.monotonic() + 10
    while fds() > before - 1 and time.monotonic() < deadline:  # (the cleared arena went too)
        time.sleep(0.05)
    assert fds() <= before - 1, "descriptors of the closed connection are still open"
    assert internal_errors(d) == 0 and "Traceback" not in d.output()
    still_serving(d)
