"""An agent across os.fork(): closed in the child, the parent's untouched. A child had held
the parent's sockets, its `close()` shut the parent's listening socket down, and its exit
unlinked the parent's shm control file (its shm peers could no longer attach). A real
fork in a fresh interpreter (the child exits normally, running its exit handlers), then a
real peer transfers with the parent over tcp and shm."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    from transfer import Agent, AgentConfig, BackendKind, DescList, Fault, Op, TransferError
    from transfer.shm import ShmSegment

    kinds = {"tcp": (BackendKind.TCP,), "shm": (BackendKind.SHM, BackendKind.TCP)}[sys.argv[1]]
    cfg = AgentConfig(backends=kinds, io_timeout_s=2.0, connect_timeout_s=2.0)
    parent = Agent("parent", cfg)
    seg = ShmSegment.create(1 << 16)  # (reachable by shm; plain memory is not)
    mem = seg.array
    mem[:] = np.arange(1 << 16, dtype=np.uint8)
    region = parent.register(seg)
    meta = parent.metadata()
    pid = os.fork()
    if pid == 0:  # the child: its copy is closed; closing it again and exiting touch nothing
        try:
            parent.register(np.zeros(16, np.uint8))
            print("child: the agent still worked", flush=True)
        except TransferError as e:
            assert e.fault is Fault.CLOSED
        parent.close()
        sys.exit(0)  # (exit handlers run: the shm control file's among them)
    assert os.waitpid(pid, 0)[1] == 0
    peer = Agent("peer", cfg)
    peer.add_peer(meta)
    back = np.zeros(1 << 16, np.uint8)
    mine = peer.prepare(DescList.uniform(peer.register(back), 1 << 12, 16))
    theirs = peer.prepare(DescList.uniform(region.region_id, 1 << 12, 16), peer="parent")
    peer.transfer(Op.READ, mine, np.arange(16), theirs, np.arange(16), timeout=5)
    assert (back == mem).all()
    print("parent ok", theirs.backend.name, flush=True)
    peer.close()
    parent.close()
    seg.close()
""")


def _run(kind: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, kind], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_forked_child_leaves_the_parents_tcp_agent_serving():
    assert _run("tcp").splitlines() == ["parent ok TCP"]


def test_a_forked_child_leaves_the_parents_shm_agent_reachable():
    assert _run("shm").splitlines() == ["parent ok SHM"]
