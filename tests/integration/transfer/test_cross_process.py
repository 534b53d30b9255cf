"""Transfers between this process and a real child process, over shm and tcp on loopback."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from transfer import (Agent, AgentConfig, AgentMetadata, BackendKind, DescList, Fault, Op,
                      ShmSegment, TransferError)
from transfer.backends.shm import ctl_name

SIZE = 8 << 20
CHILD = os.path.join(os.path.dirname(__file__), "peer_child.py")
KINDS = [BackendKind.SHM, BackendKind.TCP]


class Child:
    def __init__(self, backends: str):
        self.proc = subprocess.Popen([sys.executable, CHILD, backends, str(SIZE)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.metadata = bytes.fromhex(self.readline())

    def readline(self, timeout: float = 20.0) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("child did not answer")
        line = self.proc.stdout.readline().decode().strip()
        if not line:
            raise EOFError(f"child exited with {self.proc.poll()}")
        return line

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self.readline()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._unlink_leftovers()

    def _unlink_leftovers(self) -> None:
        """A killed child cannot unlink its shm segments; its parent (the test) does."""
        meta = AgentMetadata.decode(self.metadata)
        paths = [r.path for r in meta.regions if r.path]
        paths.append(os.path.join("/dev/shm", ctl_name(meta.agent_id)))
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


@pytest.fixture
def child():
    c = Child("shm,tcp")
    yield c
    c.stop()


@pytest.fixture
def parent():
    a = Agent("parent", AgentConfig(io_timeout_s=3.0, connect_timeout_s=3.0))
    seg = ShmSegment.create(SIZE)
    yield a, seg, a.register(seg)
    a.close()
    seg.close()


def _child_pattern() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_write_read_notify_across_processes(child, parent, kind):
    a, seg, region = parent
    peer = a.add_peer(child.metadata)
    rid = a.peer_regions(peer)[0].region_id
    remote = a.prepare(DescList.uniform(rid, 1 << 16, SIZE >> 16), peer=peer, backend=kind)
    local = a.prepare(DescList.uniform(region, 1 << 16, SIZE >> 16))
    a.post(Op.READ, local, None, remote, None).wait(10)
    assert np.array_equal(seg.array, _child_pattern())
    seg.array[:] = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
    perm = np.random.default_rng(3).permutation(len(local))
    xs = [a.post(Op.WRITE, local, perm[i::4], remote, perm[i::4], notify=b"w%d" % i)
          for i in range(4)]
    for x in xs:
        x.wait(10)
    assert child.ask("digest") == xxhash.xxh3_64_hexdigest(seg.array)
    notes = child.ask("notes").split(",")
    while len(notes) < 4:
        notes += child.ask("notes").split(",")
    assert sorted(bytes.fromhex(n) for n in notes) == [b"w0", b"w1", b"w2", b"w3"]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_child_writes_into_parent(child, parent, kind):
    a, seg, _ = parent
    a.add_peer(child.metadata)
    assert child.ask("peer " + a.metadata().hex()) == "ok"
    assert child.ask(f"write {kind.value} 1000000") == "ok"
    assert np.array_equal(seg.array[:1000000], _child_pattern()[:1000000])
    assert [n.payload for n in a.notifications(timeout=2)] == [b"child"]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_killed_peer_fails_within_bounded_time(child, parent, kind):
    a, _, region = parent
    peer = a.add_peer(child.metadata)
    rid = a.peer_regions(peer)[0].region_id
    remote = a.prepare(DescList.uniform(rid, 1 << 20, 8), peer=peer, backend=kind)
    local = a.prepare(DescList.uniform(region, 1 << 20, 8))
    a.post(Op.WRITE, local, None, remote, None).wait(10)
    child.kill()
    with pytest.raises(TransferError) as e:
        a.post(Op.WRITE, local, None, remote, None).wait(10)
    assert e.value.fault in (Fault.PEER_GONE, Fault.CONNECTION_LOST), e.value


def test_a_peer_region_truncated_under_its_mapping_fails_the_transfer_not_this_process(
        child, parent):
    """The child's region file shrunk under this process's mapping (as a buggy or hostile
    peer of the same user can do): transfers over shm that reach past the end fail with a
    TransferError, either way, where the SIGBUS of the copy killed this process; the next
    post finds the file short and says so too. Its control file shrunk: the same."""
    a, _, region = parent
    peer = a.add_peer(child.metadata)
    info = a.peer_regions(peer)[0]
    remote = a.prepare(DescList.uniform(info.region_id, 1 << 20, 8), peer=peer,
                       backend=BackendKind.SHM)
    local = a.prepare(DescList.uniform(region, 1 << 20, 8))
    a.post(Op.READ, local, None, remote, None).wait(10)  # mapped, and read whole
    os.truncate(info.path, 1 << 20)
    faults = []
    for op in (Op.READ, Op.WRITE, Op.READ):
        with pytest.raises(TransferError) as e:
            a.post(op, local, None, remote, None).wait(10)
        faults.append(e.value.fault)
    assert faults[0] is Fault.UNREGISTERED
    assert set(faults[1:]) <= {Fault.UNREGISTERED, Fault.PEER_GONE}
    # and its control segment (the flags each post reads first) shrunk to nothing
    os.truncate(os.path.join("/dev/shm", ctl_name(AgentMetadata.decode(child.metadata)
                                                  .agent_id)), 0)
    with pytest.raises(TransferError, match="control segment was truncated") as e:
        a.post(Op.READ, local, None, remote, None).wait(10)
    assert e.value.fault is Fault.PEER_GONE
    assert child.proc.poll() is None  # (the child too, while it keeps off its own files)
