"""Block bytes moved by a transfer Agent (one-sided READ/WRITE of the daemon's arena by
slot), the path a client off the daemon's host takes with `use_agent=True`."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore import wire as w
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
    return Client(url, namespace=NS, use_shm=False, use_agent=True, inline_put_bytes=0, **kw)


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
