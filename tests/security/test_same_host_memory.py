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
        assert reply.msg.code == w.ErrorCode.FORBIDDEN
        w.send_frame(u, w.Share(), w.Op.SHARE, False)
        frame, fds = w.FrameReader(u).frame_with_fds(0)
        assert frame.op is w.Op.ERROR and not fds


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
