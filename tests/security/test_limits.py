"""Limits before work: nothing but HELLO before a token passes, headers bounded while they
are decoded, connections capped and timed out, every malformed field a clear ERROR frame,
and running out of descriptors pauses the daemon instead of stopping it."""
from __future__ import annotations

import resource
import socket
import time

import msgpack
import numpy as np
import pytest

from kvstore import Client
from kvstore import wire as w
from kvstore.api import PutStatus
from kvstore.client import ConnectError
from kvstore.events import TierKind
from kvstore.keys import hash_blocks

from .conftest import (ALICE, BOB, NS, block_of, call, closed, hello_msg, metric, raw_conn,
                       rss_kib, wait_for)


@pytest.fixture
def secured(make_daemon, token_file):
    return make_daemon("--token-file", token_file)


def still_serving(daemon, token="admin-secret") -> None:
    h = hash_blocks(NS, np.arange(16) + 5)[0]
    with Client(daemon.url, token, NS, use_shm=False) as c:
        c.put(h, np.full(NS.block_bytes, 3, np.uint8))
        assert c.get(h) == bytes([3]) * NS.block_bytes


@pytest.mark.parametrize("msg", [w.Stage(nbytes=64 << 20), w.Share(), w.Exists(hashes=b"x" * 16),
                                 w.Reserve(hashes=b"x" * 16), w.Stats()])
def test_nothing_but_hello_before_authentication(secured, msg):
    with raw_conn(secured) as s:
        reply = call(s, msg)
        assert reply.op is w.Op.ERROR and "before HELLO" in reply.msg.message and closed(s)
    still_serving(secured)


def test_a_bad_token_closes_the_connection(secured):
    with raw_conn(secured) as s:
        reply = call(s, hello_msg(NS, "wrong"))
        assert reply.msg.code == w.ErrorCode.AUTH and closed(s)


def test_big_or_nested_headers_are_refused_before_they_are_decoded(secured):
    before = rss_kib(secured.pid)
    nested = b"\x81\xa1k" * 100_000  # maps inside maps
    for _ in range(16):
        with raw_conn(secured) as s:  # a 1 MiB header with no token: refused by its length
            s.sendall(w.PREFIX.pack(w.MAGIC, w.PROTOCOL_VERSION, w.Op.HELLO, 1 << 20, 0))
            reply = w.recv_frame(s, 1 << 30)
            assert reply.msg.code == w.ErrorCode.TOO_LARGE and closed(s)
        with raw_conn(secured) as s:  # small enough, but a map where none may be
            body = nested[:12 << 10]
            s.sendall(w.PREFIX.pack(w.MAGIC, w.PROTOCOL_VERSION, w.Op.HELLO, len(body), 0) + body)
            assert w.recv_frame(s, 1 << 30).msg.code == w.ErrorCode.PROTOCOL and closed(s)
    assert rss_kib(secured.pid) - before < 64 << 10, "pre-auth headers cost daemon memory"
    still_serving(secured)


@pytest.mark.parametrize("fields,needle", [
    (dict(num_layers=2 ** 40), "num_layers"),
    (dict(head_dim=0), "head_dim"),
    (dict(dtype="complex128"), "dtype"),
    (dict(model=""), "model"),
    (dict(model="m" * 5000), "model"),
    (dict(block_tokens=1 << 20, num_layers=4096, head_dim=4096), "block"),
])
def test_hello_fields_out_of_range_are_clear_errors(secured, fields, needle):
    ns = dict(model=NS.model, num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16",
              block_tokens=16)
    with raw_conn(secured) as s:
        hello = w.Hello(token="admin-secret", **{**ns, **fields})
        reply = call(s, hello)
        assert reply.op is w.Op.ERROR and needle in reply.msg.message, reply.msg
        assert reply.msg.code in (w.ErrorCode.NAMESPACE, w.ErrorCode.PROTOCOL)
    still_serving(secured)


def test_wrong_field_types_are_protocol_errors(secured):
    with raw_conn(secured) as s:
        values = ["admin-secret", NS.model, "one", 1, 64, "float16", 16, "main", "", False, b""]
        header = msgpack.packb(values, use_bin_type=True)
        s.sendall(w.PREFIX.pack(w.MAGIC, w.PROTOCOL_VERSION, w.Op.HELLO, len(header), 0) + header)
        reply = w.recv_frame(s, 1 << 30)
        assert reply.msg.code == w.ErrorCode.PROTOCOL and "num_layers" in reply.msg.message


def test_touch_read_counts_must_match_its_hashes(secured):
    """A TOUCH's read counts (4 bytes a hash) that do not match its hashes are a protocol
    error that counts nothing; matching ones count exactly, up to TOUCH_MAX_READS each."""
    h = hash_blocks(NS, np.arange(16) + 7)[0]
    with Client(secured.url, "admin-secret", NS, use_shm=False) as c:
        c.put(h, np.full(NS.block_bytes, 5, np.uint8))
    for reads in (b"\x01\x00", b"\x01\x00\x00\x00" * 2):
        with raw_conn(secured) as s:
            assert call(s, hello_msg(NS, "admin-secret")).op is w.Op.HELLO
            reply = call(s, w.Touch(hashes=h, reads=reads))
            assert reply.op is w.Op.ERROR and reply.msg.code == w.ErrorCode.PROTOCOL
            assert "read counts" in reply.msg.message
            assert closed(s)
    with raw_conn(secured) as s:
        assert call(s, hello_msg(NS, "admin-secret")).op is w.Op.HELLO
        assert call(s, w.Touch(hashes=h, reads=(7).to_bytes(4, "little"))).msg.value == 7
        assert call(s, w.Touch(hashes=h * 2)).msg.value == 2
        tiers = call(s, w.Stats()).msg.tiers
        assert tiers[0][4] == 9  # hits of the DRAM tier: 7 + 1 + 1, none from the bad ones
        # a claim of 4 billion reads counts as TOUCH_MAX_READS: no client inflates its
        # namespace's hit counters (or bytes served) without bound
        huge = call(s, w.Touch(hashes=h, reads=(0xFFFFFFFF).to_bytes(4, "little")))
        assert huge.msg.value == w.TOUCH_MAX_READS
        assert call(s, w.Stats()).msg.tiers[0][4] == 9 + w.TOUCH_MAX_READS
    still_serving(secured)


def test_a_negative_flush_want_is_a_protocol_error(secured):
    with raw_conn(secured) as s:
        assert call(s, hello_msg(NS, "admin-secret")).op is w.Op.HELLO
        assert call(s, w.Flush(want=1 << 40)).msg.value == 0  # no put channel: nothing to do
        reply = call(s, w.Flush(want=-1))
        assert reply.op is w.Op.ERROR and reply.msg.code == w.ErrorCode.PROTOCOL
        assert closed(s)
    still_serving(secured)


@pytest.mark.parametrize("msg", [w.Exists(hashes=b"x" * 16), w.Get(hashes=b"x" * 16),
                                 w.Stats(), w.Flush()])
def test_a_payload_on_an_op_that_takes_none_is_a_protocol_error(secured, msg):
    """Bytes after such a frame would be read as the next frame (here, a forged STATS):
    the connection is answered and closed instead, and nothing the bytes say is served."""
    forged = w.encode(w.Stats(), w.Op.STATS, False)
    with raw_conn(secured) as s:
        assert call(s, hello_msg(NS, "admin-secret")).op is w.Op.HELLO
        reply = call(s, msg, [forged])
        assert reply.op is w.Op.ERROR and reply.msg.code == w.ErrorCode.PROTOCOL
        assert "takes no payload" in reply.msg.message and closed(s)
    with raw_conn(secured) as s:  # before HELLO too
        reply = call(s, hello_msg(NS, "admin-secret"), [forged])
        assert reply.op is w.Op.ERROR and closed(s)
    still_serving(secured)


def test_open_reservations_per_connection_are_bounded_and_pruned(make_daemon, token_file):
    """One connection cannot pile up reservations (each is memory the daemon keeps for it):
    past 64 open a RESERVE is refused (QUOTA) and the connection stays usable; the ones the
    store reclaimed after their timeout stop counting."""
    from kvstore.daemon.session import MAX_OPEN_RESERVATIONS
    d = make_daemon("--token-file", token_file, "--reservation-timeout", "1",
                    dram_size="1MiB")
    hashes = hash_blocks(NS, np.arange(16 * (MAX_OPEN_RESERVATIONS + 2)))
    with raw_conn(d) as s:
        assert call(s, hello_msg(NS, "admin-secret")).op is w.Op.HELLO
        for h in hashes[:MAX_OPEN_RESERVATIONS]:
            assert call(s, w.Reserve(hashes=h)).op is w.Op.RESERVE
        reply = call(s, w.Reserve(hashes=hashes[-1]))
        assert reply.op is w.Op.ERROR and reply.msg.code == w.ErrorCode.QUOTA
        assert "reservations open" in reply.msg.message
        first = call(s, w.Stats()).msg  # still served
        assert first.open_reservations == MAX_OPEN_RESERVATIONS
        assert wait_for(lambda: call(s, w.Stats()).msg.open_reservations == 0)  # reclaimed
        assert call(s, w.Reserve(hashes=hashes[-1])).op is w.Op.RESERVE  # and forgotten here
    still_serving(d)


def test_open_leases_per_connection_are_bounded_and_a_get_past_them_answers_inline(
        make_daemon, token_file, monkeypatch):
    """GETs that lease DRAM slots (shm) and never release them: past MAX_OPEN_LEASES open
    on one connection a GET leases nothing and sends its bytes inline (exact), so neither
    the connection's list of ids nor the store's leases grow without bound (400k such GETs
    had piled up ~150 MiB of ids for the connection's life). Released leases, and leases
    the store ended at their TTL, stop counting."""
    from kvstore.daemon.session import MAX_OPEN_LEASES
    d = make_daemon("--token-file", token_file, "--lease-ttl", "1")
    h = hash_blocks(NS, np.arange(16) + 321)[0]
    want = block_of(h, NS.block_bytes)
    with Client(d.url, "admin-secret", NS, use_shm=False) as c:
        c.put(h, want)
    get = w.Get(hashes=h, shm=True)
    with raw_conn(d) as s:
        assert call(s, hello_msg(NS, "admin-secret")).op is w.Op.HELLO
        ids = [call(s, get).msg.lease_id for _ in range(MAX_OPEN_LEASES)]
        assert all(ids) and len(set(ids)) == MAX_OPEN_LEASES
        reply = call(s, get)
        assert reply.msg.lease_id == 0 and reply.payload_bytes == NS.block_bytes
        got = bytearray(NS.block_bytes)
        w.recv_exact(s, memoryview(got))
        assert got == want.tobytes()
        assert call(s, w.Stats()).msg.open_leases == MAX_OPEN_LEASES
        assert call(s, w.Release(lease_ids=ids[:1])).op is w.Op.RELEASE
        assert call(s, get).msg.lease_id  # room for one again
        # the store ends them at their TTL (1 s): the connection lets their ids go
        assert wait_for(lambda: call(s, w.Stats()).msg.open_leases == 0, 15)
        assert call(s, get).msg.lease_id
    still_serving(d)


def test_connections_are_capped_and_the_unauthenticated_ones_more_so(make_daemon, token_file):
    """8 connections at most, 2 of them unauthenticated; silent sockets past those 2 push
    out the oldest, so they never keep a client with a token from connecting (refusing the
    newcomer instead, as before, let 256 silent sockets lock out every client)."""
    d = make_daemon("--token-file", token_file, "--max-connections", "8")
    idle = [raw_conn(d) for _ in range(6)]  # 8 // 4 = 2 may wait unauthenticated
    try:
        for s in idle[:4]:  # the first pushed out by the third, and so on
            reply = w.recv_frame(s, 1 << 30)
            assert reply.msg.code == w.ErrorCode.UNAVAILABLE and "authenticate" in reply.msg.message
            assert closed(s)
        with raw_conn(d) as s:  # a client with a token still gets in, and is served
            assert call(s, hello_msg(NS, "admin-secret")).op is w.Op.HELLO
            assert call(s, w.Stats()).op is w.Op.STATS
        # (it too pushed out the oldest waiting, idle[4]): the last one waits alone
        assert wait_for(lambda: metric(d, "kvtier_connections ") == 1)
        for s in idle:
            s.close()
        assert wait_for(lambda: metric(d, "kvtier_connections ") == 0)  # the daemon saw them go
        authed = []
        for _ in range(8):
            s = raw_conn(d)
            assert call(s, hello_msg(NS, "admin-secret")).op is w.Op.HELLO
            authed.append(s)
        with raw_conn(d) as s:
            assert "connection limit" in w.recv_frame(s, 1 << 30).msg.message
        for s in authed:
            s.close()
        assert wait_for(lambda: _serves(d))
    finally:
        for s in idle:
            s.close()


def _serves(d) -> bool:
    try:
        still_serving(d)
        return True
    except ConnectError:
        return False
    except w.RemoteError as e:  # a store it could not open for want of descriptors
        assert e.code is w.ErrorCode.UNAVAILABLE, e
        return False


def test_silent_connections_are_closed(make_daemon, token_file):
    d = make_daemon("--token-file", token_file, "--hello-timeout", "1", "--idle-timeout", "1")
    with raw_conn(d, timeout=10) as s:  # never says HELLO
        assert closed(s)
    with raw_conn(d, timeout=10) as s:  # authenticated, then silent
        call(s, hello_msg(NS, "admin-secret"))
        assert closed(s)
    with Client(d.url, "admin-secret", NS, use_shm=False) as c:  # pooled: reconnects
        h = hash_blocks(NS, np.arange(16))[0]
        c.put(h, np.zeros(NS.block_bytes, np.uint8))
        import time
        time.sleep(1.5)
        assert c.contains_n([h]) == [True]


def test_the_idle_timeout_is_whole_silence_however_the_socket_times_out(make_daemon, token_file):
    """Once authenticated, a connection's socket timeouts are periods of at most twice
    --reservation-timeout (3 x 0.5 s of an idle timeout of 1.5 s here), the bound each
    payload read has too, so no put sets a timeout of its own. A silence past a period but
    short of the idle timeout keeps the connection; a put whose payload pauses past a
    period, within its deadline (0.5 s + 4 MiB at 4 MiB/s), is stored; a silence of the
    whole idle timeout closes it."""
    d = make_daemon("--token-file", token_file, "--idle-timeout", "1.5",
                    "--reservation-timeout", "0.25")
    hs = hash_blocks(NS, np.arange(1024 * 16) + 4242)
    payload = np.concatenate([block_of(h, NS.block_bytes) for h in hs])
    with raw_conn(d, timeout=10) as s:
        call(s, hello_msg(NS, "admin-secret"))
        time.sleep(1.1)  # two periods
        assert call(s, w.Stats()).op is w.Op.STATS
        s.sendall(w.encode(w.Put(hashes=w.pack_hashes(hs)), w.Op.PUT, False, payload.nbytes))
        s.sendall(payload[:payload.nbytes // 2].tobytes())
        time.sleep(0.8)  # past a period, not past the deadline
        s.sendall(payload[payload.nbytes // 2:].tobytes())
        reply = w.recv_frame(s, 1 << 30)
        assert reply.op is w.Op.PUT and set(reply.msg.statuses) == {0}, reply.msg
        t0 = time.monotonic()
        assert closed(s)
        assert 1.2 < time.monotonic() - t0 < 5
    with Client(d.url, "admin-secret", NS, use_shm=False) as c:
        got = np.empty_like(payload)
        assert None not in c.get_n(hs[:64], got[:64 * NS.block_bytes])
        assert np.array_equal(got[:64 * NS.block_bytes], payload[:64 * NS.block_bytes])


def test_a_hello_dribbled_a_byte_at_a_time_still_times_out(make_daemon, token_file):
    """--hello-timeout bounds the whole HELLO, not each read: a client sending a byte
    every 0.3 s (each read well within the timeout) is closed, and stops holding one of
    the few slots unauthenticated connections get (8 // 4 = 2 here)."""
    d = make_daemon("--token-file", token_file, "--hello-timeout", "1",
                    "--max-connections", "8")
    frame = w.encode(hello_msg(NS, "admin-secret"), w.Op.HELLO, False)
    slow = [raw_conn(d, timeout=0.3) for _ in range(2)]
    try:
        for sent, byte in enumerate(frame):  # ~0.3 s a byte: 1 s is 3-4 bytes in
            if all(closed(s) for s in slow):
                break
            for s in slow:
                try:
                    s.sendall(bytes([byte]))
                except OSError:
                    pass  # closed by the daemon meanwhile
        assert sent < len(frame) // 2, "a dribbled HELLO kept its connection open"
        assert wait_for(lambda: _serves(d))  # the slots they held are free again
    finally:
        for s in slow:
            s.close()


def test_out_of_descriptors_pauses_accepting_and_recovers(make_daemon, token_file):
    def few_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))
    d = make_daemon("--token-file", token_file, preexec_fn=few_fds)
    held = []
    try:
        for _ in range(120):  # more than the daemon can hold open
            s = socket.create_connection(("127.0.0.1", d.port), timeout=5)
            held.append(s)
            w.send_frame(s, hello_msg(NS, "admin-secret"), w.Op.HELLO, False)
        assert wait_for(lambda: "Too many open files" in d.output(), timeout_s=30), \
            "the test never ran the daemon out of descriptors: " + d.output()[-3000:]
        assert d.proc.poll() is None
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: _serves(d), timeout_s=20), d.output()[-4000:]
    assert d.get_json("/healthz")["status"] == "ok"
    assert metric(d, "kvtier_accept_errors_total") > 0


def test_one_tenant_cannot_take_every_connection(make_daemon, token_file):
    """With two tenants, one holds at most three quarters of --max-connections (here 6 of
    8): its next HELLO is refused (UNAVAILABLE, saying why) while the other tenant and the
    admin still get in, and a closed connection frees its place."""
    d = make_daemon("--token-file", token_file, "--max-connections", "8")
    alice = []
    try:
        for _ in range(6):
            s = raw_conn(d)
            assert call(s, hello_msg(ALICE, "alice-secret")).op is w.Op.HELLO
            alice.append(s)
        with raw_conn(d) as s:
            reply = call(s, hello_msg(ALICE, "alice-secret"))
            assert reply.op is w.Op.ERROR and reply.msg.code == w.ErrorCode.UNAVAILABLE
            assert "alice" in reply.msg.message and "--max-tenant-connections" in reply.msg.message
        assert wait_for(lambda: metric(d, "kvtier_connections ") == 6)
        with raw_conn(d) as s:  # a re-HELLO of another tenant's connection counts alike
            assert call(s, hello_msg(BOB, "bob-secret")).op is w.Op.HELLO
            reply = call(s, hello_msg(ALICE, "alice-secret"))
            assert reply.op is w.Op.ERROR and reply.msg.code == w.ErrorCode.UNAVAILABLE
            assert call(s, w.Stats()).op is w.Op.STATS  # still bob's, still served
        assert wait_for(lambda: metric(d, "kvtier_connections ") == 6)
        with Client(d.url, "bob-secret", BOB, use_shm=False) as c:
            assert c.stats().hits == 0
        still_serving(d)  # admin
        alice.pop().close()
        assert wait_for(lambda: _hello_ok(d, "alice-secret", ALICE))
    finally:
        for s in alice:
            s.close()


def test_a_tenant_at_its_cap_and_silent_sockets_lock_no_other_tenant_out(make_daemon,
                                                                        token_file):
    """One tenant at its cap (6 of 8) and two silent sockets with no token fill
    --max-connections: a new connection then pushes out the oldest silent one (a quarter
    may wait unauthenticated, and it is them who make room), so the other tenant gets in.
    It was refused ("connection limit") for as long as the silent sockets were renewed."""
    d = make_daemon("--token-file", token_file, "--max-connections", "8")
    alice, silent = [], []
    try:
        for _ in range(6):
            s = raw_conn(d)
            assert call(s, hello_msg(ALICE, "alice-secret")).op is w.Op.HELLO
            alice.append(s)
        for attempt in range(3):
            # (bob's last connection gone first: the daemon counts it until its thread ends)
            assert wait_for(lambda: metric(d, "kvtier_connections ") == 6 + len(silent))
            while len(silent) < 2:  # renewed as each is pushed out
                silent.append(raw_conn(d))
            assert wait_for(lambda: metric(d, "kvtier_connections ") == 8)
            with raw_conn(d) as s:
                assert call(s, hello_msg(BOB, "bob-secret")).op is w.Op.HELLO, attempt
                assert call(s, w.Stats()).op is w.Op.STATS
            pushed = w.recv_frame(silent.pop(0), 1 << 30)
            assert pushed.msg.code == w.ErrorCode.UNAVAILABLE
            assert "authenticate" in pushed.msg.message
        with raw_conn(d) as s:  # alice stays at her cap all the while, and a HELLO of
            # hers refused there ends its connection (kept open until its hello deadline,
            # two such did what the silent sockets did, beyond the lobby's eviction)
            reply = call(s, hello_msg(ALICE, "alice-secret"))
            assert reply.msg.code == w.ErrorCode.UNAVAILABLE and closed(s)
    finally:
        for s in alice + silent:
            s.close()


def _connect_flood(port: int, stop) -> None:
    """Open connections to 127.0.0.1:port as fast as one process can (never a byte sent),
    keeping the last 64, until `stop` is set."""
    held = []
    while not stop.is_set():
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            time.sleep(0.001)
            continue
        held.append(s)
        if len(held) > 64:
            held.pop(0).close()


def test_a_flood_of_connections_with_no_token_locks_no_client_out(make_daemon, token_file):
    """One process opening connections as fast as it can, never sending a byte: a client
    with a token still connects and is served, each time. With a thread started for every
    connection at accept, the daemon fell behind the flood, the listen queue stayed full,
    and the kernel dropped the client's SYNs: its connect timed out (5 s) two times in
    three. New connections now wait in one lobby thread until their first frame is in."""
    import multiprocessing as mp
    d = make_daemon("--token-file", token_file)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    flood = ctx.Process(target=_connect_flood, args=(d.port, stop), daemon=True)
    flood.start()
    try:
        assert wait_for(lambda: metric(d, "kvtier_connections_accepted_total") > 2000, 30)
        for _ in range(10):
            still_serving(d)
    finally:
        stop.set()
        flood.join(10)
    assert d.proc.poll() is None


def test_a_commit_of_the_wrong_size_sent_slowly_is_cut_off_and_frees_its_blocks(make_daemon):
    """A COMMIT whose payload is not the size its reservation needs is read and dropped
    (BLOCK_SIZE) by the deadline any payload has (twice --reservation-timeout, then
    4 MiB/s): sent a byte now and then, its reservation stayed open with no timeout, for as
    long as the client liked, and other clients' puts of its blocks were told EXISTS while
    their gets missed. Past the deadline the connection closes and the blocks are free."""
    d = make_daemon("--reservation-timeout", "0.25")
    hs = hash_blocks(NS, np.arange(4 * 16) + 4711)[:4]
    bb = NS.block_bytes
    with raw_conn(d, timeout=10) as s:
        assert call(s, hello_msg(NS)).op is w.Op.HELLO
        rid = call(s, w.Reserve(hashes=w.pack_hashes(hs))).msg.reservation_id
        s.sendall(w.encode(w.Commit(reservation_id=rid), w.Op.COMMIT, False, 9 * bb))
        started = time.monotonic()
        try:
            while time.monotonic() - started < 15:  # due within 0.5 s + 9 blocks at 4 MiB/s
                s.sendall(b"\0")
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - started < 10, "the trickled payload was never cut off"
    with Client(d.url, namespace=NS, use_shm=False) as c:
        assert wait_for(lambda: c.stats().open_reservations == 0)
        rows = np.stack([block_of(h, bb) for h in hs])
        assert c.put_n(hs, rows) == [PutStatus.STORED] * 4
        out = np.zeros_like(rows)
        assert None not in c.get_n(hs, out) and np.array_equal(out, rows)


def _hello_ok(d, token, ns) -> bool:
    with raw_conn(d) as s:
        return call(s, hello_msg(ns, token)).op is w.Op.HELLO


def test_a_stalled_put_to_ssd_holds_a_window_of_scratch_not_its_whole_batch(make_daemon):
    """A PUT whose blocks go to SSD is received through at most SCRATCH_WINDOW (16 MiB) of
    scratch, written as it fills: a client that stops one block short of a 64 MiB batch
    left all 64 MiB resident for as long as it liked (a few such puts exhausted the host),
    uncounted by any tenant limit. The blocks are all stored once it ends."""
    d = make_daemon("--dram-size", "0", ssd_size="256MiB")
    bb = NS.block_bytes
    n = (64 << 20) // bb
    hs = hash_blocks(NS, np.arange(n * NS.block_tokens) + 31337)
    payload = np.concatenate([block_of(h, bb) for h in hs[:4]] + [np.full((n - 4) * bb, 9, np.uint8)])
    with raw_conn(d, timeout=60) as s:
        assert call(s, hello_msg(NS)).op is w.Op.HELLO
        before = rss_kib(d.pid)
        s.sendall(w.encode(w.Put(hashes=w.pack_hashes(hs)), w.Op.PUT, False, payload.nbytes))
        s.sendall(payload[:-bb].tobytes())  # all but the last block, then silence
        assert wait_for(lambda: unread_by_daemon(s) == 0, 30)  # it took all it was sent
        grown = rss_kib(d.pid) - before
        # the window and the bookkeeping of 16k blocks (~35 MiB here), not the 64 MiB batch
        assert grown < (payload.nbytes >> 10) * 3 // 4, f"{grown} KiB resident for a stalled put"
        s.sendall(payload[-bb:].tobytes())
        reply = w.recv_frame(s, 1 << 30)
        assert reply.op is w.Op.PUT and reply.msg.statuses == b"\x00" * n
    with Client(d.url, namespace=NS, use_shm=False) as c:
        out = np.zeros((4, bb), np.uint8)
        assert None not in c.get_n(hs[:4], out)
        assert all(np.array_equal(row, block_of(h, bb)) for row, h in zip(out, hs[:4]))
        assert c.stats().tier(TierKind.SSD).used_blocks == n


def _hello(d, ns, rcvbuf: int = 0) -> socket.socket:
    """A raw connection that said HELLO for `ns` (with a small receive buffer: a client
    that reads slowly)."""
    s = raw_conn(d, timeout=60)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    assert call(s, hello_msg(ns)).op is w.Op.HELLO
    return s


def _ssd_daemon_holding(make_daemon, nbytes: int, ssd_size: str, seed: int, *args):
    """A daemon with no DRAM tier holding `nbytes` of 256 KiB blocks on SSD, each block's
    bytes `block_of` its hash; (daemon, namespace, hashes)."""
    from kvstore.keys import Namespace
    ns = Namespace("test-model", num_layers=8, num_kv_heads=8, head_dim=64)  # 256 KiB blocks
    bb, n = ns.block_bytes, nbytes // ns.block_bytes
    d = make_daemon("--dram-size", "0", *args, ssd_size=ssd_size)
    hs = hash_blocks(ns, np.arange(n * ns.block_tokens) + seed)
    with Client(d.url, namespace=ns, use_shm=False) as c:
        for i in range(0, n, 32):
            c.put_n(hs[i:i + 32], np.stack([block_of(h, bb) for h in hs[i:i + 32]]))
    return d, ns, hs


def test_a_get_of_ssd_blocks_its_client_does_not_read_holds_a_window_not_its_batch(make_daemon):
    """A GET's SSD blocks are read into scratch window by window as the reply goes out: a
    client that asked for 96 MiB of them and read nothing left all 96 MiB resident until
    its send timed out (minutes), and a few such clients exhausted the host. The reply,
    read at last, is whole and exact."""
    d, ns, hs = _ssd_daemon_holding(make_daemon, 96 << 20, "256MiB", 777)
    bb, n = ns.block_bytes, len(hs)
    with _hello(d, ns, rcvbuf=64 << 10) as s:
        before = rss_kib(d.pid)
        w.send_frame(s, w.Get(hashes=w.pack_hashes(hs)), w.Op.GET, False)
        assert wait_for(lambda: _unsent_by_daemon(s) > 0, 30)  # its send is blocked on us
        time.sleep(0.5)
        grown = rss_kib(d.pid) - before
        assert grown < (n * bb >> 10) // 2, f"{grown} KiB resident for an unread GET"
        reply = w.recv_frame(s, 1 << 30)
        assert reply.op is w.Op.GET and reply.msg.tiers == bytes([TierKind.SSD]) * n
        got = bytearray(reply.payload_bytes)
        w.recv_exact(s, memoryview(got))
    blocks = np.frombuffer(got, np.uint8).reshape(n, bb)
    assert all(np.array_equal(blocks[i], block_of(hs[i], bb)) for i in (0, 63, 64, n - 1))


def test_scratch_in_use_by_unread_gets_is_bounded_all_together(make_daemon):
    """Each GET of SSD blocks streams through two windows of scratch (16 MiB each): 24
    connections that each asked for 32 MiB and never read held 32 MiB apiece until their
    deadlines (over a minute, and asking again renews it), and the 768 connections one
    tenant may open, tens of GiB outside every memory limit. All connections' scratch
    together stays within --scratch-memory (each request's window shrinks to fit, down to
    two blocks); every reply, read at last, is whole and exact."""
    d, ns, hs = _ssd_daemon_holding(make_daemon, 32 << 20, "128MiB", 888,
                                    "--scratch-memory", "24MiB")
    bb, n = ns.block_bytes, len(hs)
    before = rss_kib(d.pid)
    conns = []
    try:
        for _ in range(8):
            s = _hello(d, ns, rcvbuf=64 << 10)
            w.send_frame(s, w.Get(hashes=w.pack_hashes(hs)), w.Op.GET, False)
            conns.append(s)
        for s in conns:  # every one's send is blocked on us
            assert wait_for(lambda: _unsent_by_daemon(s) > 0, 30)
        time.sleep(0.5)
        grown = (rss_kib(d.pid) - before) << 10
        assert grown < (24 << 20) + 8 * 2 * bb + (16 << 20), \
            f"{grown >> 20} MiB resident for 8 unread GETs of 32 MiB"
        for s in conns:
            reply = w.recv_frame(s, 1 << 30)
            assert reply.op is w.Op.GET and reply.msg.tiers == bytes([TierKind.SSD]) * n
            got = bytearray(reply.payload_bytes)
            w.recv_exact(s, memoryview(got))
            blocks = np.frombuffer(got, np.uint8).reshape(n, bb)
            assert all(np.array_equal(blocks[i], block_of(hs[i], bb)) for i in range(n))
    finally:
        for s in conns:
            s.close()


@pytest.mark.parametrize("how", ["stalled puts", "refused payloads"])
def test_scratch_in_use_by_stalled_puts_is_bounded_all_together(make_daemon, how):
    """The same bound for payloads the daemon takes in: puts of SSD blocks that stall
    partway (each through a window of scratch), and payloads it refuses and drains (a PUT
    of the wrong size: 4 MiB of scratch each, which bypassed the bound). Each connection
    ends by its deadline or when the rest comes; every byte is read, the daemon healthy."""
    d, ns, hs = _ssd_daemon_holding(make_daemon, 1 << 20, "512MiB", 999,
                                    "--scratch-memory", "8MiB")
    bb = ns.block_bytes
    before = rss_kib(d.pid)
    conns = []
    try:
        for i in range(16):
            s = _hello(d, ns)
            more = hash_blocks(ns, np.arange(64 * ns.block_tokens) + 10_000 * (i + 1))
            wrong = 1 if how == "refused payloads" else 0  # a byte short of whole blocks
            nbytes = 64 * bb - wrong
            s.sendall(w.encode(w.Put(hashes=w.pack_hashes(more)), w.Op.PUT, False, nbytes))
            s.sendall(bytes(nbytes - bb))  # all but the last block's worth, then silence
            conns.append((s, nbytes))
        for s, _ in conns:
            assert wait_for(lambda: unread_by_daemon(s) == 0, 30)  # it took what was sent
        grown = (rss_kib(d.pid) - before) << 10
        assert grown < (8 << 20) + 16 * bb + (16 << 20), \
            f"{grown >> 20} MiB resident for 16 stalled payloads of 16 MiB"
        for s, nbytes in conns:
            s.sendall(bytes(bb))
            reply = w.recv_frame(s, 1 << 30)
            if how == "stalled puts":
                assert reply.op is w.Op.PUT and reply.msg.statuses == b"\x00" * 64
            else:
                assert reply.op is w.Op.ERROR and reply.msg.code == w.ErrorCode.BLOCK_SIZE
    finally:
        for s, _ in conns:
            s.close()
    with Client(d.url, namespace=ns, use_shm=False) as c:
        assert None not in c.get_n(hs[:2], np.zeros((2, bb), np.uint8))


def test_scratch_kept_by_idle_connections_is_bounded_all_together(make_daemon):
    """Each connection keeps the scratch its last request took (a GET of SSD blocks: two
    16 MiB windows), up to 64 MiB, and all of them together at most SCRATCH_KEEP_TOTAL
    (256 MiB): past it a connection lets its own go after its request, back to the OS.
    30 connections idle after one 32 MiB GET each held 1 GiB (+33.7 MiB each), outside
    every memory cap; the 768 connections a tenant may hold, 24 GiB."""
    from kvstore.daemon.session import SCRATCH_KEEP_TOTAL
    d, ns, hs = _ssd_daemon_holding(make_daemon, 32 << 20, "128MiB", 555)
    bb, n = ns.block_bytes, len(hs)
    before = rss_kib(d.pid)
    conns = []
    try:
        for _ in range(20):
            s = _hello(d, ns)
            reply = call(s, w.Get(hashes=w.pack_hashes(hs)))
            assert reply.op is w.Op.GET and reply.payload_bytes == n * bb
            got = bytearray(reply.payload_bytes)
            w.recv_exact(s, memoryview(got))
            conns.append(s)
        grown = (rss_kib(d.pid) - before) << 10
        assert grown < SCRATCH_KEEP_TOTAL + (128 << 20), f"{grown >> 20} MiB kept by 20 idle"
        blocks = np.frombuffer(got, np.uint8).reshape(n, bb)  # (and the last reply exact)
        assert all(np.array_equal(blocks[i], block_of(hs[i], bb)) for i in (0, n - 1))
    finally:
        for s in conns:
            s.close()
    still_serving(d)


def _dram_daemon_holding(make_daemon, nbytes: int, seed: int, *args):
    """As _ssd_daemon_holding, the blocks in DRAM (no SSD tier)."""
    from kvstore.keys import Namespace
    ns = Namespace("test-model", num_layers=8, num_kv_heads=8, head_dim=64)  # 256 KiB blocks
    bb, n = ns.block_bytes, nbytes // ns.block_bytes
    d = make_daemon("--dram-size", "64MiB", *args, ssd_size="0")
    hs = hash_blocks(ns, np.arange(n * ns.block_tokens) + seed)
    with Client(d.url, namespace=ns, use_shm=False) as c:
        c.put_n(hs, np.stack([block_of(h, bb) for h in hs]))
    return d, ns, hs


@pytest.mark.parametrize("tier", ["ssd", "dram"])
def test_a_get_its_client_reads_too_slowly_is_cut_off_and_holds_nothing(make_daemon, tier):
    """A GET's reply must go out at 4 MiB/s at least, after twice --reservation-timeout of
    grace (as a put's payload must come in): a client reading a few bytes now and then
    kept its blocks held and the connection's thread busy until its idle timeout, however
    long. Past the deadline the connection is closed and every hold goes back. Streamed
    from SSD, and sent straight from DRAM slots: there a reply of up to 4 MiB had no
    deadline (it was taken to fit the socket buffers, 1 MiB since 8b264da)."""
    if tier == "ssd":  # (due within 0.2 s + 5 s)
        d, ns, hs = _ssd_daemon_holding(make_daemon, 20 << 20, "128MiB", 999,
                                        "--reservation-timeout", "0.1")
    else:  # (due within 0.2 s + 1 s)
        d, ns, hs = _dram_daemon_holding(make_daemon, 4 << 20, 998,
                                         "--reservation-timeout", "0.1")
    bb, n = ns.block_bytes, len(hs)
    with raw_conn(d, timeout=60) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        assert call(s, hello_msg(ns)).op is w.Op.HELLO
        w.send_frame(s, w.Get(hashes=w.pack_hashes(hs)), w.Op.GET, False)
        started, got = time.monotonic(), 0
        while True:  # ~1-2 MiB/s
            chunk = s.recv(64 << 10)
            if not chunk:
                break
            got += len(chunk)
            time.sleep(0.03 if tier == "ssd" else 0.06)
        assert got < n * bb, "the whole reply came"
        assert time.monotonic() - started < 20
    with Client(d.url, namespace=ns, use_shm=False) as c:
        assert wait_for(lambda: c.remove_n(hs[:1]) == 1, 10), "the block was still held"
        assert c.remove_n(hs[1:]) == n - 1, "a reader count was left held"


def _unsent_by_daemon(s: socket.socket) -> int:
    """Bytes the daemon has queued toward `s` that we have not read: its send queue
    (/proc/net/tcp, the daemon's end of this loopback connection)."""
    here, there = s.getsockname()[1], s.getpeername()[1]
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, remote, _, queues = line.split()[1:5]
            if int(local.split(":")[1], 16) == there and int(remote.split(":")[1], 16) == here:
                return int(queues.split(":")[0], 16)
    return 0


def unread_by_daemon(s: socket.socket) -> int:
    """Bytes we sent on `s` that the daemon has not read yet: our send queue plus its receive
    queue (/proc/net/tcp, the daemon's end of this loopback connection)."""
    import fcntl
    import struct
    import termios
    ours = struct.unpack("i", fcntl.ioctl(s, termios.TIOCOUTQ, b"\0" * 4))[0]
    here, there = s.getsockname()[1], s.getpeername()[1]
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, remote, _, queues = line.split()[1:5]
            if int(local.split(":")[1], 16) == there and int(remote.split(":")[1], 16) == here:
                return ours + int(queues.split(":")[1], 16)
    return ours


def test_half_sent_http_requests_cannot_starve_the_data_plane_of_descriptors(secured):
    """The control plane had no cap on connections and no deadline for a request's head:
    a few hundred half-sent requests (no token needed) held their descriptors for as long
    as their senders liked, and every new namespace then failed with "Too many open
    files". Past a cap the control plane closes new connections at once."""
    import os
    from kvstore.daemon import httpguard
    port = int(secured.http.rsplit(":", 1)[1])
    before = len(os.listdir(f"/proc/{secured.pid}/fd"))
    socks = []
    try:
        for _ in range(httpguard.MAX_HTTP_CONNECTIONS + 200):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            socks.append(s)
        time.sleep(0.5)
        held = len(os.listdir(f"/proc/{secured.pid}/fd")) - before
        assert held <= httpguard.MAX_HTTP_CONNECTIONS + 8, held
        still_serving(secured)  # a namespace opened now gets its descriptors
    finally:
        for s in socks:
            s.close()


def _http_get(daemon, path: str, token: str = "", timeout: float = 5) -> int:
    import urllib.error
    import urllib.request
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(daemon.http + path, headers=headers),
                                    timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_kept_alive_strangers_cannot_lock_the_admin_out_of_the_control_port(secured):
    """The control port refused every connection past its cap: a stranger holding the 128
    slots with kept-alive connections, each sending a token-free /healthz now and then,
    kept the admin's /stats (and /metrics scrapes, a pool's /cluster calls) out for as
    long as it liked. Now a newcomer takes an idle connection's place, strangers' first;
    here with the slots held and a thread opening new token-free connections meanwhile."""
    import threading
    from kvstore.daemon import httpguard
    port = int(secured.http.rsplit(":", 1)[1])
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    socks, stop = [], threading.Event()

    def hold() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(request)
        s.recv(4096)
        return s

    def churn() -> None:
        while not stop.is_set():
            try:
                socks.append(hold())
            except OSError:
                pass
    try:
        for _ in range(httpguard.MAX_HTTP_CONNECTIONS):
            socks.append(hold())
        churner = threading.Thread(target=churn, daemon=True)
        churner.start()
        answers = [_http_get(secured, "/stats", "admin-secret") for _ in range(20)]
        assert answers == [200] * 20
        assert _http_get(secured, "/metrics", "admin-secret") == 200
    finally:
        stop.set()
        for s in list(socks):
            s.close()


def test_clears_stuck_behind_stalled_puts_leave_stats_answering(make_daemon, token_file):
    """A clear waits for its namespace's requests to end, a PUT whose payload never comes
    by its deadline. It waited in the default executor, where /stats, /metrics and the
    cluster's snapshots run: a tenant stalling a PUT on each of six of its namespaces and
    clearing them all left the admin's /stats unanswered. Clears wait in threads of their
    own now."""
    import threading
    from kvstore.keys import Namespace
    daemon = make_daemon("--token-file", token_file, "--reservation-timeout", "60")
    socks, ids = [], []
    try:
        for i in range(6):
            ns = Namespace(f"stall-{i}", num_layers=1, num_kv_heads=1, head_dim=64,
                           tenant="alice")
            s = raw_conn(daemon, timeout=30)
            socks.append(s)
            assert call(s, hello_msg(ns, "alice-secret")).op is w.Op.HELLO
            hs = hash_blocks(ns, np.arange(16 * 8))
            s.sendall(w.encode(w.Put(hashes=w.pack_hashes(hs)), w.Op.PUT, False,
                               8 * ns.block_bytes) + b"x")  # and never the rest
            ids.append(f"{ns.ns_id:016x}")
        time.sleep(0.3)

        def clear(ns_id: str) -> None:
            import urllib.request
            req = urllib.request.Request(daemon.http + f"/admin/namespaces/{ns_id}/clear",
                                         data=b"", method="POST",
                                         headers={"Authorization": "Bearer alice-secret"})
            try:
                urllib.request.urlopen(req, timeout=120).read()
            except OSError:
                pass
        for ns_id in ids:
            threading.Thread(target=clear, args=(ns_id,), daemon=True).start()
        time.sleep(1.0)
        assert _http_get(daemon, "/stats", "admin-secret", timeout=10) == 200
        assert _http_get(daemon, "/metrics", "admin-secret", timeout=10) == 200
    finally:
        for s in socks:
            s.close()


def test_malformed_http_requests_cannot_flood_the_log(make_daemon):
    """Each malformed request a stranger sent the control port was logged as an ERROR with
    its 11-line traceback; now one WARNING line per 10 s says how many came."""
    daemon = make_daemon()
    port = int(daemon.http.rsplit(":", 1)[1])
    for _ in range(50):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHo\x01st: x\r\n\r\n")
            assert b" 400 " in s.recv(100)
    assert _http_get(daemon, "/healthz") == 200
    time.sleep(0.2)
    out = daemon.output()
    assert "Traceback" not in out and out.count("malformed HTTP request") == 1, out[-2000:]
