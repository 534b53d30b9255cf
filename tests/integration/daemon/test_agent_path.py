"""Block bytes moved by a transfer Agent (one-sided READ/WRITE of the daemon's arena by
slot), the path a client off the daemon's host takes with `use_agent=True`."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import wire as w
from kvstore.api import PutStatus
from kvstore.client import Client
from kvstore.client.conn import Connection, parse_url
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks
from transfer import AgentMetadata

from .conftest import NS, block_of

BB = NS.block_bytes


def blocks(hs):
    return np.stack([block_of(h, BB) for h in hs])


def agent_client(url: str, **kw) -> Client:
    return Client(url, namespace=NS, use_shm=False, use_agent=True, inline_put_bytes=0,
                  inline_get_bytes=0, **kw)


def test_a_restarted_daemon_gets_a_new_agent_and_the_client_follows(make_daemon):
    d = make_daemon()
    hs = hash_blocks(NS, np.arange(100 * 16) + 7)  # 64 fit DRAM, the rest on SSD
    with agent_client(d.url) as c:
        assert c.transport == "agent"
        c.put_n(hs, blocks(hs))
        assert d.stop() == 0
        d.start()
        dst = np.zeros((100, BB), np.uint8)
        assert None not in c.get_n(hs, dst)  # reconnects, re-learns the agent, reads
        assert c.transport == "agent"
        assert (dst == blocks(hs)).all()
        more = hash_blocks(NS, np.arange(4 * 16) + 10**6)
        c.put_n(more, blocks(more))
        assert c.get_n(more, dst[:4]) == [TierKind.DRAM] * 4 and (dst[:4] == blocks(more)).all()


@pytest.fixture
def staged(monkeypatch):
    """Counts the transfers that went through the client's staging rows (a tcp transfer of
    DIRECT_BYTES or more lands in the caller's rows instead); DIRECT_BYTES made 4 blocks,
    so these 4 KiB blocks show both ways."""
    from kvstore.client import agentpath
    monkeypatch.setattr(agentpath, "DIRECT_BYTES", 4 * BB)
    calls = []
    real = agentpath.AgentPath._stage

    def stage(self, n):
        calls.append(n)
        return real(self, n)
    monkeypatch.setattr(agentpath.AgentPath, "_stage", stage)
    return calls


def test_big_tcp_transfers_land_in_the_callers_rows_and_small_ones_go_through_staging(
        make_daemon, staged):
    d = make_daemon()
    hs = hash_blocks(NS, np.arange(100 * 16) + 31)  # 64 fit DRAM, the rest go to SSD
    src = blocks(hs)
    with agent_client(d.url) as c:
        assert c.transport == "agent"
        c.put_n(hs[:60], src[:60])  # written by the agent, straight from src
        assert staged == []
        c.put_n(hs[60:62], src[60:62])  # 2 blocks: through staging
        assert staged == [2]
        c.put_n(hs[62:], torch.from_numpy(src[62:]))
        dst = np.zeros((100, BB), np.uint8)
        tiers = c.get_n(hs, dst)  # DRAM blocks read by the agent (a subset of the rows:
        assert None not in tiers and TierKind.SSD in tiers  # SSD ones came inline)
        assert (dst == src).all()
        leased = sum(t is TierKind.DRAM for t in tiers)
        assert leased >= 4 and staged == [2], "the DRAM blocks went straight into dst"
        out = torch.zeros(100, BB, dtype=torch.uint8)
        assert None not in c.get_n(hs, out) and (out.numpy() == src).all()
        assert staged == [2]
        rows = [np.zeros(BB, np.uint8) for _ in hs]  # not one array: staging
        assert None not in c.get_n(hs, rows)
        assert all((r == s).all() for r, s in zip(rows, src)) and len(staged) == 2
        few = np.zeros((2, BB), np.uint8)
        dram = [h for h, t in zip(hs, tiers) if t is TierKind.DRAM][:2]
        assert c.get_n(dram, few) == [TierKind.DRAM] * 2 and len(staged) == 3
        assert (few == blocks(dram)).all()


def test_a_direct_read_cut_off_by_the_daemon_fails_cleanly_and_the_agent_ends(make_daemon, staged):
    """The daemon dies between GET's reply and the agent's read: the get fails (nothing
    of a failed transfer may land in the caller's rows later, so the agent is closed),
    and once the daemon is back the client reads through a new agent."""
    from kvstore.client import agentpath
    d = make_daemon()
    hs = hash_blocks(NS, np.arange(8 * 16) + 77)
    with agent_client(d.url, timeout_s=5.0, connect_timeout_s=2.0) as c:
        c.put_n(hs, blocks(hs))
        path = c._agent
        real = agentpath.AgentPath.read

        stopped = []

        def read_after_stop(self, *a):
            if not stopped:
                stopped.append(d.stop())
            return real(self, *a)
        agentpath.AgentPath.read = read_after_stop
        try:
            with pytest.raises(ConnectionError):
                c.get_n(hs, np.zeros((8, BB), np.uint8))
        finally:
            agentpath.AgentPath.read = real
        assert path.broken and path.agent._closed
        d.start()
        dst = np.zeros((8, BB), np.uint8)
        assert None not in c.get_n(hs, dst) and (dst == blocks(hs)).all()  # (from SSD)
        more = hash_blocks(NS, np.arange(8 * 16) + 10**6)
        c.put_n(more, blocks(more))
        assert c.get_n(more, dst) == [TierKind.DRAM] * 8 and (dst == blocks(more)).all()
        assert c._agent is not path and staged == []


def test_by_default_small_puts_and_every_tcp_get_go_inline(make_daemon, monkeypatch):
    """One request carrying the bytes beats the agent's two: puts up to inline_put_bytes
    (512 KiB) go inline, and gets too over the agent's tcp backend whatever their size
    (the default inline_get_bytes=None); set, inline_get_bytes bounds them as it says."""
    from kvstore.client import agentpath
    moved = []
    for name in ("read", "write"):
        real = getattr(agentpath.AgentPath, name)

        def spy(self, slots, *a, _real=real, _name=name):
            moved.append((_name, len(slots)))
            return _real(self, slots, *a)
        monkeypatch.setattr(agentpath.AgentPath, name, spy)
    d = make_daemon()
    hs = hash_blocks(NS, np.arange(40 * 16) + 55)
    with Client(d.url, namespace=NS, use_shm=False, use_agent=True) as c:
        assert c.transport == "agent" and c._agent.over_tcp
        c.put_n(hs[:4], blocks(hs[:4]))
        assert moved == []
        c.inline_put_bytes = 8 * BB
        c.put_n(hs[4:40], blocks(hs[4:40]))
        assert moved == [("write", 36)]
        dst = np.zeros((40, BB), np.uint8)
        assert c.get_n(hs, dst) == [TierKind.DRAM] * 40 and moved == [("write", 36)]
        assert (dst == blocks(hs)).all()
        c.inline_get_bytes = 8 * BB
        dst[:] = 0
        assert c.get_n(hs[:8], dst[:8]) == [TierKind.DRAM] * 8 and len(moved) == 1
        assert None not in c.get_n(hs[8:40], dst[8:40]) and moved[1:] == [("read", 32)]
        assert (dst == blocks(hs)).all()


def test_each_namespace_exports_only_its_own_arena_and_only_after_auth(make_daemon, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("admin-secret\nteam-secret team\n")
    d = make_daemon("--token-file", str(tokens))
    addr = parse_url(d.url)
    other = Namespace("other-model", num_layers=2, num_kv_heads=1, head_dim=64)
    metas = []
    for ns, token in ((NS, "admin-secret"), (other, "admin-secret")):
        conn = Connection(addr, token, ns, 5.0, 5.0, want_agent=True)
        info = conn.info
        conn.close()
        meta = AgentMetadata.decode(info.agent_meta)
        (region,) = meta.regions
        assert region.region_id == info.agent_region
        assert region.size == info.shm_slots * ns.block_bytes  # the arena, nothing more
        metas.append(meta)
    assert metas[0].agent_id != metas[1].agent_id, "one agent per namespace"
    with pytest.raises(w.AuthError):
        Connection(addr, "wrong", NS, 5.0, 5.0, want_agent=True)
    conn = Connection(addr, "admin-secret", NS, 5.0, 5.0, want_agent=False)
    assert conn.info.agent_meta == b"", "metadata only for clients that ask"
    conn.close()


def test_without_exported_arenas_the_client_falls_back_to_inline_bytes(make_daemon):
    d = make_daemon("--agent-backends", "none")
    hs = hash_blocks(NS, np.arange(3 * 16) + 5)
    with agent_client(d.url) as c:
        assert c.transport == "tcp"
        c.put_n(hs, blocks(hs))
        dst = np.zeros((3, BB), np.uint8)
        assert c.get_n(hs, dst) == [TierKind.DRAM] * 3 and (dst == blocks(hs)).all()


def test_an_unknown_agent_backend_is_a_clear_error(tmp_path):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "kvstore.daemon", "--agent-backends",
                           "rdma", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "agent backend 'rdma'" in done.stderr + done.stdout


def test_the_agents_connection_setup_keeps_to_the_clients_connect_timeout(make_daemon,
                                                                          monkeypatch):
    """A daemon that stops answering while the client's agent first connects to its own:
    the agent's HELLO waits the client's connect_timeout_s, not the agent's own default
    (5 s: a put with connect_timeout_s=0.5 took over 5 s to fail)."""
    import os
    import signal
    import time
    import transfer.agent as agent_mod
    d = make_daemon()
    real = agent_mod.Agent.transfer

    def stop_then_transfer(self, *a, **kw):
        os.kill(d.pid, signal.SIGSTOP)  # its agent never answers the HELLO
        return real(self, *a, **kw)

    with agent_client(d.url) as first:  # the namespace and its agent set up (arena made,
        first.contains_n([])  # exported) before the client with 0.5 s timeouts says HELLO:
        # on a loaded CI host that first HELLO outlasted 0.5 s, failing before the agent
        # was tried
    monkeypatch.setattr(agent_mod.Agent, "transfer", stop_then_transfer)
    hs = hash_blocks(NS, np.arange(16 * 16) + 77)
    with agent_client(d.url, timeout_s=0.5, connect_timeout_s=0.5) as c:
        t0 = time.monotonic()
        try:
            with pytest.raises(Exception):
                c.put_n(hs, blocks(hs))
            took = time.monotonic() - t0
        finally:
            os.kill(d.pid, signal.SIGCONT)
        assert took < 4.5, took  # (the agent's own default alone is 5 s)


def test_a_write_stalled_past_its_reservation_never_lands_in_another_block(make_daemon,
                                                                          monkeypatch):
    """A client off the daemon's host writes its reserved DRAM slots one-sided, through the
    transfer agent, and may still be at it when the reservation times out: those slots
    stay out of use until it is done (its COMMIT refused, nothing stored), however long
    that takes. They had gone back at once, and a write stalled past the timeout landed in
    a slot another block had been committed to, served to every reader of that block."""
    import threading
    import time

    from kvstore.client import agentpath
    d = make_daemon("--reservation-timeout", "0.5", "--dram-size", "16KiB", "--ssd-size", "0")
    real, stalled = agentpath.AgentPath.write, threading.Event()

    def slow(self, *a, **kw):
        if not stalled.is_set():
            stalled.set()
            time.sleep(2.5)  # past the timeout, and past one more
        return real(self, *a, **kw)
    monkeypatch.setattr(agentpath.AgentPath, "write", slow)
    late = hash_blocks(NS, np.arange(16) + 4242)
    others = hash_blocks(NS, np.arange(6 * 16) + 4343)
    failed = []
    with agent_client(d.url) as writer, Client(d.url, namespace=NS, use_shm=False) as c:
        def put_late():
            try:
                writer.put_n(late, np.full((1, BB), 0x11, np.uint8))
            except Exception as e:  # noqa: BLE001 - what the late COMMIT says
                failed.append(e)
        t = threading.Thread(target=put_late)
        t.start()
        assert stalled.wait(10)
        time.sleep(1.5)  # the reservation reclaimed, and a second timeout passed
        for h in others:  # 4 slots: every free one taken, the oldest blocks evicted
            c.put_n([h], blocks([h]))
        t.join(10)
        assert failed and "nothing was stored" in str(failed[0])
        got = np.zeros((len(others), BB), np.uint8)
        tiers = c.get_n(others, got)
        assert any(tiers)
        for h, tier, row in zip(others, tiers, got):
            if tier is not None:
                assert (row == block_of(h, BB)).all(), "another block's bytes"
        assert not any(writer.get_n(late, got[:1]))


def test_a_put_of_read_only_bytes_big_enough_to_go_direct_is_staged(make_daemon):
    """A put from `bytes` (read-only) of DIRECT_BYTES or more: the agent registers no
    read-only array, and the put had failed (ConnectionError, the agent marked broken)
    where staging it works."""
    from kvstore.client.agentpath import DIRECT_BYTES
    d = make_daemon(dram_size="4MiB")
    n = DIRECT_BYTES // BB + 2
    hs = hash_blocks(NS, list(range(n * NS.block_tokens)))
    data = blocks(hs)
    with agent_client(d.url) as c:
        assert c.put_n(hs, data.tobytes()) == [PutStatus.STORED] * n
        out = np.zeros_like(data)
        assert c.get_n(hs, out) == [TierKind.DRAM] * n and np.array_equal(out, data)
