"""Same-host shared memory: no names to find, descriptors only for authenticated clients of
that namespace (read-only where they only read), usable by any uid, and nothing reachable
through the daemon's /proc entries by another process."""
from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore import Client
from kvstore import wire as w
from kvstore.events import TierKind
from kvstore.keys import hash_blocks
from transfer.shm import F_ADD_SEALS, F_SEAL_FUTURE_WRITE

from .conftest import (ALICE, BOB, NS, ROOT, block_of, call, closed, hello_msg, local_conn,
                       nobody_can_run_here, raw_conn)


@pytest.fixture
def secured(make_daemon, token_file):
    return make_daemon("--token-file", token_file)


def test_nothing_in_dev_shm_while_clients_use_shared_memory(secured):
    before = set(os.listdir("/dev/shm"))
    hs = hash_blocks(ALICE, np.arange(8 * 16))
    with Client(secured.url, "alice-secret", ALICE) as c:
        assert c.transport == "shm"
        c.put_n(hs, np.stack([block_of(h, ALICE.block_bytes) for h in hs]))  # staged
        out = np.zeros((8, ALICE.block_bytes), np.uint8)
        assert None not in c.get_n(hs, out)
        assert set(os.listdir("/dev/shm")) <= before


def test_share_and_stage_need_the_local_socket_and_a_hello(secured):
    with raw_conn(secured) as s:
        call(s, hello_msg(ALICE, "alice-secret"))
        for msg in (w.Share(), w.Stage(nbytes=4096)):
            reply = call(s, msg)
            assert reply.op is w.Op.ERROR and "local socket" in reply.msg.message
    with local_conn(secured, ALICE, "alice-secret") as u:  # before HELLO on this connection
        w.send_frame(u, w.Share(), w.Op.SHARE, False)
        frame, fds = w.FrameReader(u).frame_with_fds(0)
        assert frame.op is w.Op.ERROR and not fds and closed(u)
    with local_conn(secured, ALICE, "alice-secret") as u:  # a wrong token ends it
        reply = call(u, hello_msg(ALICE, "bob-secret"))
        assert reply.msg.code == w.ErrorCode.FORBIDDEN and closed(u)


def test_the_descriptors_are_this_namespaces_and_read_only_where_only_read(secured):
    with Client(secured.url, "bob-secret", BOB) as bob:
        bob.put_n(hash_blocks(BOB, np.arange(16)), [np.full(BOB.block_bytes, 7, np.uint8)])
    with local_conn(secured, ALICE, "alice-secret") as u:
        ok = call(u, hello_msg(ALICE, "alice-secret")).msg
        w.send_frame(u, w.Share(), w.Op.SHARE, False)
        frame, (arena, directory) = w.FrameReader(u).frame_with_fds(0)
        try:
            assert frame.msg.arena_id == ok.arena_id
            data = mmap.mmap(arena, 0, mmap.MAP_SHARED, mmap.PROT_READ)
            assert bytes([7]) * 64 not in data[4096:], "another tenant's block is in here"
            data.close()
            with pytest.raises(OSError):
                os.write(directory, b"x")
            with pytest.raises(OSError):
                mmap.mmap(directory, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            for fd in (arena, directory):
                with pytest.raises(OSError):  # sealed: a shrink would crash the daemon
                    os.ftruncate(fd, 0)
                with pytest.raises(PermissionError):  # and the seals are final: no client
                    fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE)  # can stop the others
        finally:  # from mapping the arena writable
            w.close_fds([arena, directory])
    with Client(secured.url, "alice-secret", ALICE) as c:  # the next client still can
        assert c.transport == "shm"
        c.put_n(hash_blocks(ALICE, np.arange(16) + 3), [np.full(ALICE.block_bytes, 3, np.uint8)])


NOBODY_CLIENT = textwrap.dedent("""
    import os, sys, numpy as np
    from kvstore import Client
    from kvstore.keys import Namespace, hash_blocks
    url, token, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ns = Namespace("shared-model", num_layers=1, num_kv_heads=1, head_dim=64, tenant="alice")
    with Client(url, token, ns) as c:
        hs = hash_blocks(ns, np.arange(4 * 16) + 999)
        data = np.stack([np.full(ns.block_bytes, i + 1, np.uint8) for i in range(4)])
        c.put_n(hs, data)
        out = np.zeros_like(data)
        ok = None not in c.get_n(hs, out) and np.array_equal(out, data)
        print("transport", c.transport, "roundtrip", ok, flush=True)
    for what in (f"/proc/{pid}/fd", f"/proc/{pid}/mem", f"/proc/{pid}/environ"):
        try:
            os.listdir(what) if what.endswith("fd") else open(what, "rb").read(1)
            print("READ", what)
        except OSError:
            print("denied", what)
""")


NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def run_as_nobody(daemon) -> str:
    why = nobody_can_run_here()
    if why:
        pytest.fail(why)
    out = subprocess.run([*NOBODY, sys.executable, "-c", NOBODY_CLIENT, daemon.url,
                          "alice-secret", str(daemon.pid)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert "transport shm roundtrip True" in out.stdout, out.stdout + out.stderr
    return out.stdout


def test_a_client_of_another_uid_gets_the_fast_path_and_nothing_else(secured):
    out = run_as_nobody(secured)  # the daemon runs as root here
    assert "READ" not in out and out.count("denied") == 3, out


def test_processes_of_the_daemons_own_uid_cannot_reach_into_it():
    """A daemon run as nobody, a client also run as nobody: the client gets what the
    protocol hands it, and not the daemon's descriptors or memory through /proc."""
    import shutil
    import tempfile

    from .conftest import TOKENS, Daemon
    home = tempfile.mkdtemp(prefix="kvtier-nobody-")  # pytest's tmp dirs are root-only
    os.chmod(home, 0o777)
    with open(os.path.join(home, "tokens"), "w") as f:
        f.write(TOKENS)
    d = Daemon(os.path.join(home, "data"), "--token-file", os.path.join(home, "tokens"),
               wrap=NOBODY)
    try:
        d.start()
        out = run_as_nobody(d)
        assert "READ" not in out and out.count("denied") == 3, out
    finally:
        d.close()
        shutil.rmtree(home, ignore_errors=True)


def _share(u) -> w.Frame:
    """SHARE's reply (its descriptors closed)."""
    w.send_frame(u, w.Share(), w.Op.SHARE, False)
    frame, fds = w.FrameReader(u).frame_with_fds(0)
    w.close_fds(fds)
    return frame


def test_replies_with_descriptors_wait_for_the_last_to_be_read_and_are_bounded(secured):
    """The kernel counts descriptors in replies not read yet against the daemon's uid and
    passes none past its open-file limit: one tenant asking for SHAREs and never reading
    made every other tenant's SHARE fail. A SHARE (STAGE, PUTS) while an earlier reply is
    unread is refused (QUOTA), and one connection gets MAX_DESCRIPTOR_REPLIES at most."""
    import time

    from kvstore.daemon.session import MAX_DESCRIPTOR_REPLIES
    with local_conn(secured, ALICE, "alice-secret") as u:
        call(u, hello_msg(ALICE, "alice-secret"))
        w.send_frame(u, w.Share(), w.Op.SHARE, False)
        w.send_frame(u, w.Share(), w.Op.SHARE, False)
        time.sleep(0.5)  # (both served before the first reply is read)
        reader = w.FrameReader(u)
        first, fds = reader.frame_with_fds(0)
        w.close_fds(fds)
        assert first.op is w.Op.SHARE and len(fds) == 2
        second, fds = reader.frame_with_fds(0)
        assert second.msg.code == w.ErrorCode.QUOTA and "not read yet" in second.msg.message
        assert not fds
        for _ in range(MAX_DESCRIPTOR_REPLIES - 1):
            assert _share(u).op is w.Op.SHARE
        refused = _share(u)
        assert refused.msg.code == w.ErrorCode.QUOTA and "the most one may" in refused.msg.message
        assert call(u, w.Stats()).op is w.Op.STATS  # served on
    with Client(secured.url, "bob-secret", BOB) as bob:  # and others are not touched
        assert bob.transport == "shm"


def test_a_stage_asks_for_more_and_a_connections_stages_are_bounded(secured):
    """STAGE replaces the connection's staging segment, but the client may keep mapping the
    old one: 16 STAGEs of 64 MiB held 1 GiB. A STAGE must ask for more than the segment
    it has, and one connection's STAGEs come to MAX_STAGED_BYTES at most."""
    from kvstore.daemon.session import MAX_STAGE_BYTES, MAX_STAGED_BYTES
    with local_conn(secured, ALICE, "alice-secret") as u:
        call(u, hello_msg(ALICE, "alice-secret"))
        reader = w.FrameReader(u)

        def stage(nbytes):
            w.send_frame(u, w.Stage(nbytes=nbytes), w.Op.STAGE, False)
            frame, fds = reader.frame_with_fds(0)
            w.close_fds(fds)
            return frame
        assert stage(4096).op is w.Op.STAGE
        assert stage(4096).msg.code == w.ErrorCode.QUOTA
        sizes = [MAX_STAGE_BYTES // 2, MAX_STAGE_BYTES * 3 // 4, MAX_STAGE_BYTES]
        ops = [stage(n) for n in sizes]
        assert 4096 + sum(sizes) > MAX_STAGED_BYTES
        assert [f.op for f in ops[:2]] == [w.Op.STAGE] * 2
        assert ops[2].msg.code == w.ErrorCode.QUOTA


def test_a_put_channel_ended_by_a_new_hello_gets_its_idle_timeout_back(make_daemon,
                                                                      token_file):
    """A put channel has no idle timeout (it is silent by design); a re-HELLO ends the
    channel, and the connection's idle timeout must come back: it stayed off for the
    connection's life, so a silent one held its thread and its place for good."""
    d = make_daemon("--token-file", token_file, "--idle-timeout", "1")
    with local_conn(d, ALICE, "alice-secret") as u:
        call(u, hello_msg(ALICE, "alice-secret"))
        w.send_frame(u, w.Puts(), w.Op.PUTS, False)
        frame, fds = w.FrameReader(u).frame_with_fds(0)
        w.close_fds(fds)
        assert frame.op is w.Op.PUTS
        assert call(u, hello_msg(ALICE, "alice-secret")).op is w.Op.HELLO
        assert closed(u)  # within the socket's 5 s: the idle timeout (1 s) closed it


def test_descriptors_a_client_keeps_are_close_on_exec(secured):
    """A program the client's process starts must not inherit the namespace's slot
    directory (every DRAM block's hash) or a put channel's doorbell: descriptors received
    with SHARE and PUTS were not close-on-exec (the arena's and the ring's were)."""
    with Client(secured.url, "alice-secret", ALICE) as c:
        hs = hash_blocks(ALICE, np.arange(4 * 16))
        c.put_n(hs, np.ones((4, ALICE.block_bytes), np.uint8))
        assert c.get_n(hs, np.zeros((4, ALICE.block_bytes), np.uint8)).count(None) == 0
        kinds = set()
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
                flags = fcntl.fcntl(int(name), fcntl.F_GETFD)
            except OSError:
                continue
            if target.startswith("/memfd:") or "eventfd" in target:
                kinds.add(target.split(" ")[0])
                assert flags & fcntl.FD_CLOEXEC, target
        assert kinds, "the client holds no shared-memory descriptors"


def test_a_clobbered_arena_header_sends_new_clients_inline_not_away(secured):
    """Any same-host client of a namespace can write its arena: one that overwrote the
    arena's layout header made every new client of the namespace fail to start
    (ConfigError). It now goes inline over the local socket, and works."""
    with local_conn(secured, ALICE, "alice-secret") as u:
        call(u, hello_msg(ALICE, "alice-secret"))
        w.send_frame(u, w.Share(), w.Op.SHARE, False)
        _, (arena, directory) = w.FrameReader(u).frame_with_fds(0)
        try:
            m = mmap.mmap(arena, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            m[0:8] = b"GARBAGE!"
            m.close()
        finally:
            w.close_fds([arena, directory])
    with Client(secured.url, "alice-secret", ALICE) as c:
        hs = hash_blocks(ALICE, np.arange(16) + 99)
        want = np.stack([block_of(h, ALICE.block_bytes) for h in hs])
        c.put_n(hs, want)
        got = np.zeros_like(want)
        assert c.get_n(hs, got) == [TierKind.DRAM] and np.array_equal(got, want)
