"""Registration of each memory kind, metadata encoding, descriptor helpers."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from transfer import (Agent, AgentConfig, AgentMetadata, BackendKind, DescList, Fault,
                      FileRegion, MemKind, Op, RegionInfo, TransferError)

LOCAL = AgentConfig(backends=(BackendKind.LOCAL,))


@pytest.fixture
def agents():
    a, b = Agent("a", LOCAL), Agent("b", LOCAL)
    yield a, b
    a.close()
    b.close()


def _roundtrip(a: Agent, b: Agent, src_mem, dst_mem, nbytes: int) -> None:
    rs, rd = a.register(src_mem), b.register(dst_mem)
    a.add_peer(b.metadata())
    local = a.prepare(DescList.uniform(rs, nbytes, 1))
    remote = a.prepare(DescList.uniform(rd.region_id, nbytes, 1), peer="b")
    a.post(Op.WRITE, local, None, remote, None).wait(1)


def test_torch_tensors_of_any_dtype(agents):
    a, b = agents
    src = torch.randn(4, 8, 16, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    _roundtrip(a, b, src, dst, src.numel() * 2)
    assert torch.equal(src, dst)


def test_numpy_to_torch_and_bytearray(agents):
    a, b = agents
    src = np.arange(1000, dtype=np.float32)
    dst = bytearray(4000)
    _roundtrip(a, b, src, dst, 4000)
    assert np.array_equal(np.frombuffer(dst, np.float32), src)


def test_file_region_is_shared_with_the_file(agents, tmp_path):
    a, b = agents
    path = tmp_path / "blocks.bin"
    path.write_bytes(b"\0" * 20000)
    src = np.full(5000, 7, np.uint8)
    region = FileRegion(str(path), offset=12345, length=5000)
    _roundtrip(a, b, src, region, 5000)
    data = path.read_bytes()
    assert data[12345:17345] == b"\7" * 5000 and not data[:12345].strip(b"\0")


def test_unsupported_and_bad_memory(agents):
    a, _ = agents
    with pytest.raises(TransferError) as e:
        a.register("not memory")
    assert e.value.fault is Fault.INVALID
    with pytest.raises(TransferError):
        a.register(np.zeros((4, 4), np.uint8)[:, ::2])  # not contiguous
    with pytest.raises(TransferError):
        a.register(np.zeros(0, np.uint8))
    region = a.register(np.zeros(4, np.uint8))
    a.deregister(region)
    with pytest.raises(TransferError) as e:
        a.deregister(region)
    assert e.value.fault is Fault.UNREGISTERED


def test_metadata_roundtrip_and_malformed():
    with Agent("m", AgentConfig(backends=(BackendKind.LOCAL, BackendKind.TCP))) as a:
        a.register(np.zeros(64, np.uint8))
        a.register(np.zeros(64, np.uint8), export=False)
        meta = AgentMetadata.decode(a.metadata())
        assert meta.name == "m" and meta.tcp_addr[0] == "127.0.0.1"
        assert [(r.region_id, r.size, r.kind) for r in meta.regions] == [(1, 64, MemKind.HOST)]
    for blob in (b"\xc1", msgpack.packb([99, "x", "y", "h", 1, None, []]),
                 msgpack.packb({"a": 1}), b""):
        with pytest.raises(TransferError) as e:
            AgentMetadata.decode(blob)
        assert e.value.fault is Fault.PROTOCOL


def test_desclist_helpers():
    d = DescList.uniform(3, 100, 4, start=10, stride=150)
    assert d.offsets.tolist() == [10, 160, 310, 460] and d.nbytes == 400 and len(d) == 4
    t = DescList.from_tuples([(1, 0, 5), (2, 5, 6)])
    assert t.region_ids.tolist() == [1, 2] and t.lengths.tolist() == [5, 6]
    with pytest.raises(TransferError):
        DescList([1, 2], [0], [1])


def test_read_only_arrays_are_refused_at_registration(agents):
    """As read-only buffers are: a READ into one over tcp killed the connection's receiving
    thread (and left its transfers pending), over local and shm a bare ValueError."""
    a, _ = agents
    ro = np.zeros(4096, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(TransferError, match="read-only") as e:
        a.register(ro)
    assert e.value.fault is Fault.INVALID


def test_an_shm_peer_refreshed_after_prepare_keeps_serving_the_lists_prepared_before():
    """A peer's metadata learned again (it registered another region) dropped its shm
    mappings, and the next post of a list prepared before raised a bare KeyError; now the
    mappings of regions that did not change stay, and the new region is reached too."""
    from transfer import ShmSegment
    cfg = AgentConfig(backends=(BackendKind.SHM, BackendKind.TCP), io_timeout_s=2.0)
    a, b = Agent("a", cfg), Agent("b", cfg)
    segs = [ShmSegment.create(1 << 16), ShmSegment.create(1 << 16)]
    try:
        segs[0].array[:4096] = 7
        rb = b.register(segs[0])
        a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        mine = np.zeros(4096, np.uint8)
        local = a.prepare(DescList.uniform(a.register(mine), 4096, 1))
        remote = a.prepare(DescList.uniform(rb.region_id, 4096, 1), peer="b")
        assert remote.backend is BackendKind.SHM
        segs[1].array[:4096] = 9
        rb2 = b.register(segs[1])
        a.add_peer(b.metadata())  # (refreshed: same agent, one region more)
        a.post(Op.READ, local, [0], remote, [0]).wait(3)
        assert (mine == 7).all()
        remote2 = a.prepare(DescList.uniform(rb2.region_id, 4096, 1), peer="b")
        a.post(Op.READ, local, [0], remote2, [0]).wait(3)
        assert (mine == 9).all()
    finally:
        a.close()
        b.close()
        for s in segs:
            s.close()


@pytest.mark.parametrize("region", [[-1, 4096, 1, None, 0], [10 ** 11, 4096, 1, None, 0],
                                    [1, 0, 1, None, 0], [1, 4096, 1, "/x", -5]])
def test_forged_region_ids_and_sizes_in_metadata_are_refused(region):
    """A negative region id overwrote another region's size in prepare's lookup table (an
    offset of 1 GiB then passed the local check against a 4 KiB region); an id of 1e11
    made prepare allocate a 745 GiB table. Such metadata is refused when decoded."""
    good = AgentMetadata("p", "x" * 32, "h", 1, ("127.0.0.1", 1),
                         (RegionInfo(1, 4096, MemKind.HOST),)).encode()
    fields = msgpack.unpackb(good)
    fields[6] = [region]
    a = Agent("a", LOCAL)
    try:
        with pytest.raises(TransferError) as e:
            a.add_peer(msgpack.packb(fields))
        assert e.value.fault is Fault.PROTOCOL
    finally:
        a.close()


def test_an_agent_never_closed_leaves_no_control_file_behind(tmp_path):
    """A process that exits without closing its agent left /dev/shm/kvt-ctl-<id> (64 KiB)
    for good; it is unlinked at interpreter exit."""
    import subprocess
    import sys
    script = ("from transfer import Agent, AgentConfig, BackendKind\n"
              "a = Agent('a', AgentConfig(backends=(BackendKind.SHM,)))\n"
              "print(a.agent_id, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    from transfer.backends.shm import ctl_name
    import os
    assert not os.path.exists(f"/dev/shm/{ctl_name(out.stdout.strip())}")
