import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from rocksdict import Rdict

from kvstore.errors import ConfigError, TierIOError
from kvstore.fsck import fsck
from kvstore.keys import Namespace, hash_blocks
from kvstore.layout import HEADER_BYTES, checksum, decode_header, encode_header
from kvstore.tiers import slabfile, ssdindex
from kvstore.tiers.slabfile import stride_of
from kvstore.tiers.ssd import SsdTier
from kvstore.tiers.ssdindex import parse_entry

NS = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
HASHES = hash_blocks(NS, list(range(40)))


def pytest_generate_tests(metafunc):
    """Every test here runs on both ways the tier moves payloads: through the C module
    (kvstore/tiers/_slabio.c, where it was built) and through Python's os.pwritev/preadv
    (where it was not). A test that patches those calls (`python_io`) runs on the second."""
    if "io_path" in metafunc.fixturenames:
        python_only = metafunc.definition.get_closest_marker("python_io") is not None
        metafunc.parametrize("io_path", ["python"] if python_only else ["native", "python"],
                             indirect=True)


@pytest.fixture(autouse=True)
def io_path(request, monkeypatch):
    if request.param == "native":
        assert slabfile.NATIVE, "kvstore.tiers._slabio is missing or unbound: reinstall " \
                                "kvtier with a C compiler (pip install -e .)"
    else:
        monkeypatch.setattr(slabfile, "NATIVE", False)
    return request.param


def _blocks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NS.block_bytes), dtype=torch.uint8, generator=g)


def _payload(directory, slot: int) -> bytes:
    """A slot's payload as on disk: slabs.dat at slot * stride (a page-rounded block)."""
    with open(directory / "slabs.dat", "rb") as f:
        f.seek(slot * stride_of(NS.block_bytes))
        return f.read(NS.block_bytes)


def _header(directory, slot: int):
    """A slot's block header as on disk: headers.dat at slot * 64."""
    with open(directory / "headers.dat", "rb") as f:
        f.seek(slot * HEADER_BYTES)
        return decode_header(f.read(HEADER_BYTES))


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_slots_hold_aligned_payloads_headers_apart_and_the_index_only_slots(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))
    assert _payload(tmp_path, slots[1]) == _blocks(2)[1].numpy().tobytes()
    assert _header(tmp_path, slots[1]).block_hash == HASHES[1]
    tier.index.flush()  # entries are written in groups (see the next test)
    entry = parse_entry(bytes(HASHES[1]), tier.raw_db()[bytes(HASHES[1])])
    assert entry[1] == slots[1] and len(tier.raw_db()[bytes(HASHES[1])]) == 16
    tier.close()



def test_the_slab_file_grows_from_a_small_extent_doubling_up_to_the_largest(tmp_path,
                                                                            monkeypatch):
    """A tier that may grow large but holds one block takes FIRST_EXTENT_BYTES of disk, not
    a whole 256 MiB extent (a test suite's small tiers filled a CI disk that way); each
    next extent is as big as the file already is, up to EXTENT_BYTES, and never past the
    tier's capacity."""
    stride = stride_of(NS.block_bytes)
    tier = SsdTier(NS, str(tmp_path / "one"), 1 << 20)
    tier.write_n(tier.alloc_n(1), HASHES[:1], _blocks(1))
    assert os.path.getsize(tmp_path / "one" / "slabs.dat") == slabfile.FIRST_EXTENT_BYTES
    assert os.path.getsize(tmp_path / "one" / "headers.dat") == \
        slabfile.FIRST_EXTENT_BYTES // stride * HEADER_BYTES
    tier.close()

    monkeypatch.setattr(slabfile, "FIRST_EXTENT_BYTES", 4 * stride)
    monkeypatch.setattr(slabfile, "EXTENT_BYTES", 16 * stride)
    tier = SsdTier(NS, str(tmp_path / "many"), 70)
    sizes = []
    for _ in range(70):
        assert len(tier.alloc_n(1)) == 1
        size = os.path.getsize(tmp_path / "many" / "slabs.dat") // stride
        if not sizes or sizes[-1] != size:
            sizes.append(size)
    assert sizes == [4, 8, 16, 32, 48, 64, 70]
    assert tier.alloc_n(1) is None  # at capacity
    tier.close()


def test_a_batch_written_in_several_hashed_runs_lands_whole(tmp_path, monkeypatch):
    """A write is split into pwritevs of WRITE_RUN_BYTES (each hashed right after it), a
    read into preadvs of HASHED_RUN_BYTES: every block of a batch, across the splits and
    around a gap in its slots, is on disk with its own header and reads back intact."""
    monkeypatch.setattr(slabfile, "WRITE_RUN_BYTES", 3 * NS.block_bytes)
    monkeypatch.setattr(slabfile, "HASHED_RUN_BYTES", 2 * NS.block_bytes)
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(10)
    slots = slots[:4] + slots[5:]  # a gap: two runs of consecutive slots, split further
    blocks = _blocks(9, seed=3)
    tier.write_n(slots, HASHES[:9], blocks)
    for i, slot in enumerate(slots):
        assert _payload(tmp_path, slot) == blocks[i].numpy().tobytes()
        assert _header(tmp_path, slot).block_hash == HASHES[i]
    out = torch.zeros_like(blocks)
    assert tier.read_n(slots, HASHES[:9], out) == [True] * 9
    assert torch.equal(out, blocks)
    tier.close()

@pytest.fixture
def chunked(monkeypatch):
    """Blocks of NS go the way big ones do (bigger than WRITE_RUN_BYTES, as big as
    CHUNKED_BLOCK_BYTES): written and read in pieces of 300 bytes, the last one short,
    each hashed right after its own pwritev / preadv."""
    monkeypatch.setattr(slabfile, "CHUNKED_BLOCK_BYTES", NS.block_bytes)
    monkeypatch.setattr(slabfile, "CHUNK_BYTES", 300)
    monkeypatch.setattr(slabfile, "WRITE_RUN_BYTES", 300)


def test_big_blocks_move_in_hashed_chunks_and_a_damaged_chunk_is_a_miss(tmp_path, chunked,
                                                                       monkeypatch, io_path):
    """Big blocks are written and read a chunk at a time, each hashed next to its I/O:
    the bytes on disk, the checksum in the header, and what reads back are those of a
    block moved whole; a byte flipped in any chunk fails that block alone. (The calls
    themselves are seen on the Python path; the C module makes the same ones.)"""
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(5)
    blocks = _blocks(5, seed=4)
    written, real = [], os.pwritev

    def pwritev(fd, bufs, offset):
        if fd == tier.slabs.fd:
            written.append((offset, [memoryview(b).nbytes for b in bufs]))
        return real(fd, bufs, offset)
    monkeypatch.setattr(slabfile.os, "pwritev", pwritev)
    tier.write_n(slots, HASHES[:5], blocks)
    monkeypatch.setattr(slabfile.os, "pwritev", real)
    pad = stride_of(NS.block_bytes) - NS.block_bytes
    if io_path == "python":
        assert written == [(slot * stride_of(NS.block_bytes) + at,
                            [300] if at < 900 else [124, pad])
                           for slot in slots for at in (0, 300, 600, 900)]
    else:
        assert written == []
    with open(tmp_path / "slabs.dat", "rb") as f:  # each slot's pad written as zeros
        for slot in slots:
            f.seek(slot * stride_of(NS.block_bytes) + NS.block_bytes)
            assert f.read(pad) == bytes(pad)
    for i, slot in enumerate(slots):
        assert _payload(tmp_path, slot) == blocks[i].numpy().tobytes()
        assert _header(tmp_path, slot).checksum == checksum(blocks[i])
    out = torch.zeros_like(blocks)
    assert tier.read_n(slots, HASHES[:5], out) == [True] * 5
    assert torch.equal(out, blocks)
    stride = stride_of(NS.block_bytes)
    _flip(tmp_path / "slabs.dat", slots[1] * stride + 450)  # the second chunk
    _flip(tmp_path / "slabs.dat", slots[3] * stride + NS.block_bytes - 1)  # the short last
    assert tier.read_n(slots, HASHES[:5], torch.zeros_like(blocks)) == [True, False, True,
                                                                        False, True]
    tier.close()


@pytest.mark.python_io
def test_a_chunk_that_cannot_be_read_fails_its_block_and_the_rest_read(tmp_path, monkeypatch,
                                                                       chunked):
    """An I/O error in the middle of a big block (the third chunk of the second block) is a
    miss for that block; every other block reads whole."""
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(3)
    blocks = _blocks(3, seed=5)
    tier.write_n(slots, HASHES[:3], blocks)
    bad, real = slots[1] * stride_of(NS.block_bytes) + 600, os.preadv

    def preadv(fd, bufs, offset):
        if offset == bad:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset)
    monkeypatch.setattr(slabfile.os, "preadv", preadv)
    out = torch.zeros_like(blocks)
    assert tier.read_n(slots, HASHES[:3], out) == [True, False, True]
    assert torch.equal(out[0], blocks[0]) and torch.equal(out[2], blocks[2])
    tier.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["runs", "chunks"])
def test_a_chunk_past_the_end_of_the_file_fails_its_block_and_the_rest_read(tmp_path, chunked):
    """A block whose last chunk (or a run's last block) lies past the end of the slab file
    (cut short under a running tier) is a miss; the blocks before it read whole, and the
    blocks of a failed run are read again one by one."""
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(3)
    blocks = _blocks(3, seed=5)
    tier.write_n(slots, HASHES[:3], blocks)
    stride = stride_of(NS.block_bytes)
    os.truncate(tmp_path / "slabs.dat", max(slots) * stride + 700)  # inside its third chunk
    out = torch.zeros_like(blocks)
    assert tier.read_n(slots, HASHES[:3], out) == [s != max(slots) for s in slots]
    for i, slot in enumerate(slots):
        if slot != max(slots):
            assert torch.equal(out[i], blocks[i])
    tier.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["runs", "chunks"])
def test_a_write_the_kernel_refuses_fails_cleanly_and_writes_no_header(tmp_path, chunked):
    """A payload write the kernel refuses (the slab file's descriptor swapped for a
    read-only one: EBADF from the real pwritev, on whichever path moves the bytes) raises
    a TierIOError naming the file, and writes no header; the next write, once the
    descriptor takes writes again, lands and reads back."""
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(4)
    blocks = _blocks(4, seed=7)
    fd = tier.slabs.fd
    saved, readonly = os.dup(fd), os.open(tmp_path / "slabs.dat", os.O_RDONLY)
    try:
        os.dup2(readonly, fd)
        with pytest.raises(TierIOError, match="slabs.dat"):
            tier.write_n(slots[:2], HASHES[:2], blocks[:2])
        os.dup2(saved, fd)
    finally:
        os.close(saved)
        os.close(readonly)
    _no_header_written_and_the_next_write_lands(tier, slots, blocks)


def _no_header_written_and_the_next_write_lands(tier, slots, blocks) -> None:
    """After a refused write of blocks 0-1 into slots 0-1: neither slot has a header, and
    blocks 2-3 then write into slots 2-3 and read back whole."""
    assert [h for _, h, _ in tier.slabs.headers(slots[:2])] == [None, None]
    tier.write_n(slots[2:], HASHES[2:4], blocks[2:])
    out = torch.zeros_like(blocks[2:])
    assert tier.read_n(slots[2:], HASHES[2:4], out) == [True, True]
    assert torch.equal(out, blocks[2:])
    tier.close()


@pytest.mark.python_io
@pytest.mark.parametrize("chunked", [False, True], ids=["runs", "chunks"])
@pytest.mark.parametrize("fail_at", [1, 2, 7])
def test_a_write_the_disk_refuses_midway_fails_cleanly(tmp_path, monkeypatch, fail_at,
                                                       chunked):
    """A payload write that fails (ENOSPC), at the first call of a run or a big block's
    first chunk, after a short one took part of it, or in the second block, raises a
    TierIOError and writes no header; the next write, once the disk takes it, lands."""
    if chunked:
        monkeypatch.setattr(slabfile, "CHUNKED_BLOCK_BYTES", NS.block_bytes)
        monkeypatch.setattr(slabfile, "CHUNK_BYTES", 300)
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(4)
    blocks = _blocks(4, seed=7)
    real, calls = os.pwritev, []

    def pwritev(fd, bufs, offset):
        if fd == tier.slabs.fd:
            calls.append(offset)
            if len(calls) == fail_at:
                raise OSError(28, "No space left on device")
            first = memoryview(bufs[0]).cast("B")  # a short write: the rest comes next
            return real(fd, [first[:1000]], offset)
        return real(fd, bufs, offset)
    monkeypatch.setattr(slabfile.os, "pwritev", pwritev)
    with pytest.raises(TierIOError, match="No space left"):
        tier.write_n(slots[:2], HASHES[:2], blocks[:2])
    assert len(calls) == fail_at
    monkeypatch.setattr(slabfile.os, "pwritev", real)
    _no_header_written_and_the_next_write_lands(tier, slots, blocks)


class _Blocking:
    """Stands in for the call that moves a run's payload (os.pwritev on the Python path,
    _slabio.write_blocks on the C one): the first call waits for `go`, then does the real
    thing; `inside` is set while it waits."""

    def __init__(self, real) -> None:
        self.real, self.inside, self.go = real, threading.Event(), threading.Event()

    def __call__(self, *args):
        if not self.inside.is_set():
            self.inside.set()
            assert self.go.wait(30)
        return self.real(*args)


def test_close_waits_for_a_payload_write_in_flight_and_refuses_new_ones(tmp_path, monkeypatch,
                                                                        io_path):
    """A write in flight when the tier closes keeps its descriptors until it returns: the C
    path holds the descriptor's number for a whole run, and a close mid-run sent the rest
    of it (up to 19 MiB) into the next file the process opened, which got that number.
    Close now waits for it; a write after close is a TierIOError, a read all misses."""
    tier = SsdTier(NS, str(tmp_path), 16)
    slabs = tier.slabs
    slots = tier.alloc_n(4)
    blocks = _blocks(4, seed=11)
    if io_path == "native":
        blocking = _Blocking(slabfile._slabio.write_blocks)
        monkeypatch.setattr(slabfile, "_slabio", SimpleNamespace(
            write_blocks=blocking, read_blocks=slabfile._slabio.read_blocks))
    else:
        blocking = _Blocking(os.pwritev)
        monkeypatch.setattr(slabfile.os, "pwritev", blocking)
    writer = threading.Thread(target=slabs.write_n, args=(slots[:2], HASHES[:2],
                                                         [memoryview(b.numpy()) for b in blocks[:2]]))
    writer.start()
    assert blocking.inside.wait(30)
    closer = threading.Thread(target=slabs.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive() and slabs.fd >= 0  # waiting for the write
    with pytest.raises(TierIOError, match="closed"):  # (refused at once, while it waits)
        slabs.write_n(slots[2:3], HASHES[2:3], [memoryview(blocks[2].numpy())])
    assert slabs.read_n(slots[:1], [0], [memoryview(torch.zeros_like(blocks[0]).numpy())]) \
        == [False]
    blocking.go.set()
    writer.join(30)
    closer.join(30)
    assert not closer.is_alive() and slabs.fd == -1 and slabs.hfd == -1
    for i, slot in enumerate(slots[:2]):  # the write in flight landed whole, where it belongs
        assert _payload(tmp_path, slot) == blocks[i].numpy().tobytes()
    tier.close()


def test_a_batch_of_big_blocks_refused_midway_leaves_no_header_of_it(tmp_path, chunked,
                                                                     monkeypatch, io_path):
    """Big blocks' headers go after every payload of their batch, on both paths: a batch
    into two runs of slots whose second run the disk refuses has no header on disk for
    the first run either (a crash before the abort erased them would otherwise bring back,
    at the next open, blocks of a put that was told it failed)."""
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(6)
    slots = [slots[0], slots[5]]  # two runs
    blocks = _blocks(2, seed=12)
    calls = []
    if io_path == "native":
        real = slabfile._slabio.write_blocks

        def write_blocks(*args):
            calls.append(args[1])
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
            return real(*args)
        monkeypatch.setattr(slabfile, "_slabio", SimpleNamespace(
            write_blocks=write_blocks, read_blocks=slabfile._slabio.read_blocks))
    else:
        real_pwritev = os.pwritev

        def pwritev(fd, bufs, offset):
            if fd == tier.slabs.fd and offset >= slots[1] * stride_of(NS.block_bytes):
                raise OSError(28, "No space left on device")
            return real_pwritev(fd, bufs, offset)
        monkeypatch.setattr(slabfile.os, "pwritev", pwritev)
    with pytest.raises(TierIOError, match="No space left"):
        tier.write_n(slots, HASHES[:2], blocks)
    monkeypatch.undo()
    assert [h for _, h, _ in tier.slabs.headers(slots)] == [None, None]
    tier.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_reads_into_a_list_of_typed_tensors_on_padded_slots(tmp_path, dtype):
    """Destinations given as a list of typed CPU tensors (not bytes): the Python path
    counted a short transfer's progress in items, not bytes, and failed with an
    IndexError on slots with a pad."""
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(3)
    blocks = _blocks(3, seed=13)
    tier.write_n(slots, HASHES[:3], blocks)
    item = torch.tensor([], dtype=dtype).element_size()
    out = [torch.zeros(NS.block_bytes // item, dtype=dtype) for _ in range(3)]
    assert tier.read_n(slots, HASHES[:3], out) == [True] * 3
    assert all(o.view(torch.uint8).equal(b) for o, b in zip(out, blocks))
    tier.close()


def test_a_block_whole_on_disk_whose_pad_was_cut_reads(tmp_path):
    """The file cut inside the last slot's pad, after its payload: that block is whole and
    reads, alone or in a run (the Python path read a lone block with its pad, failed, and
    called it a miss)."""
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(3)
    blocks = _blocks(3, seed=14)
    tier.write_n(slots, HASHES[:3], blocks)
    last = max(slots)
    os.truncate(tmp_path / "slabs.dat", last * stride_of(NS.block_bytes) + NS.block_bytes + 10)
    i = slots.index(last)
    out = torch.zeros_like(blocks)
    assert tier.read_n([last], [HASHES[i]], out[:1]) == [True]
    assert torch.equal(out[0], blocks[i])
    assert tier.read_n(slots, HASHES[:3], out) == [True] * 3
    assert torch.equal(out, blocks)
    tier.close()


def test_readers_in_many_threads_get_their_own_verdicts(tmp_path, chunked):
    """Readers in eight threads at once, each reading every block in its own order (one
    damaged), each get their own blocks and verdicts, none another's."""
    tier = SsdTier(NS, str(tmp_path), 16)
    slots = tier.alloc_n(8)
    blocks = _blocks(8, seed=6)
    tier.write_n(slots, HASHES[:8], blocks)
    _flip(tmp_path / "slabs.dat", slots[5] * stride_of(NS.block_bytes) + 10)
    expected = [i != 5 for i in range(8)]

    def reader(k):
        for _ in range(50):
            order = [(k + j) % 8 for j in range(8)]
            out = torch.zeros_like(blocks)
            ok = tier.read_n([slots[i] for i in order], [HASHES[i] for i in order], out)
            assert ok == [expected[i] for i in order]
            assert all(torch.equal(out[j], blocks[i]) for j, i in enumerate(order) if i != 5)
        return True
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(reader, range(8)))
    tier.close()


@pytest.mark.python_io
@pytest.mark.parametrize("chunked", [False, True], ids=["runs", "chunks"])
@pytest.mark.parametrize("head_dim", [16, 64], ids=["padded-slots", "page-sized-blocks"])
def test_short_transfers_are_carried_on_to_the_last_byte(tmp_path, monkeypatch, head_dim,
                                                        chunked):
    """pwritev / preadv may move fewer bytes than asked (a signal, a filesystem's limit):
    every write and read, of one block (one buffer when a block fills its page-rounded
    slot, a block and its pad otherwise), of a run, or of a big block's chunk, is carried
    on until it is whole."""
    ns = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype="float16",
                   block_tokens=4)
    if chunked:
        monkeypatch.setattr(slabfile, "CHUNKED_BLOCK_BYTES", ns.block_bytes)
        monkeypatch.setattr(slabfile, "CHUNK_BYTES", 1500)
    hashes = hash_blocks(ns, list(range(24)))

    def short(fn):
        def call(fd, bufs, offset):
            first = memoryview(bufs[0]).cast("B")  # at most 1000 bytes, of the first buffer
            return fn(fd, [first[:1000]], offset)
        return call
    tier = SsdTier(ns, str(tmp_path), 16)
    slots = tier.alloc_n(6)
    blocks = torch.randint(0, 256, (6, ns.block_bytes), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(9))
    monkeypatch.setattr(slabfile.os, "pwritev", short(os.pwritev))
    monkeypatch.setattr(slabfile.os, "preadv", short(os.preadv))
    tier.write_n(slots[:1], hashes[:1], blocks[:1])  # one block
    tier.write_n(slots[1:], hashes[1:6], blocks[1:])  # a run, headers several at once
    out = torch.zeros_like(blocks)
    assert tier.read_n(slots[:1], hashes[:1], out[:1]) == [True]
    assert tier.read_n(slots[1:], hashes[1:6], out[1:]) == [True] * 5
    assert torch.equal(out, blocks)
    monkeypatch.undo()
    stride = stride_of(ns.block_bytes)
    with open(tmp_path / "slabs.dat", "rb") as f, open(tmp_path / "headers.dat", "rb") as hf:
        for i, slot in enumerate(slots):
            f.seek(slot * stride)
            assert f.read(ns.block_bytes) == blocks[i].numpy().tobytes()
            hf.seek(slot * HEADER_BYTES)
            assert decode_header(hf.read(HEADER_BYTES)).block_hash == hashes[i]
    tier.close()


def test_blocks_survive_close_and_reopen(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4)
    tier.write_n(tier.alloc_n(3), HASHES[:3], _blocks(3))
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 4)
    found = dict(tier.recover())
    assert set(found) == set(HASHES[:3]) and tier.num_free() == 1
    out = torch.zeros(3, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[h] for h in HASHES[:3]], HASHES[:3], out) == [True] * 3
    assert torch.equal(out, _blocks(3))
    tier.close()


def _crash_after(tmp_path, num_blocks: int, num_slots: int, body: str) -> None:
    """Run `body` in a child process holding an SsdTier at `tmp_path` (`tier`, `hashes`,
    `data`: the blocks `_blocks(num_blocks)` makes here), then SIGKILL it: no close, no
    flush, a crash. The child moves payloads the way this test does (`io_path`)."""
    child = textwrap.dedent(f"""
        import os, torch
        from kvstore.keys import Namespace, hash_blocks
        from kvstore.tiers import slabfile
        from kvstore.tiers.ssd import SsdTier
        slabfile.NATIVE = {slabfile.NATIVE!r}
        ns = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
        hashes = hash_blocks(ns, list(range(40)))
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 256, ({num_blocks}, ns.block_bytes), dtype=torch.uint8, generator=g)
        tier = SsdTier(ns, {str(tmp_path)!r}, {num_slots})
    """) + textwrap.dedent(body) + textwrap.dedent("""
        print("written", flush=True)
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert proc.returncode == -9 and "written" in proc.stdout, proc.stderr


def test_blocks_written_before_a_process_crash_are_found(tmp_path):
    _crash_after(tmp_path, 5, 8, "tier.write_n(tier.alloc_n(5), hashes[:5], data)")
    tier = SsdTier(NS, str(tmp_path), 8)
    found = dict(tier.recover())
    assert set(found) == set(HASHES[:5])
    out = torch.zeros(5, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[h] for h in HASHES[:5]], HASHES[:5], out) == [True] * 5
    assert torch.equal(out, _blocks(5))
    tier.close()


def test_index_writes_go_in_groups_in_order_and_close_writes_the_rest(tmp_path, monkeypatch):
    """No put or free writes RocksDB by itself: entries and deletes wait in one queue, in
    the order they came, and the put that makes GROUP_OPS writes them all (a free, under
    the store's lock, never does); close writes what is left. A block freed and then
    stored again in the same group ends indexed."""
    monkeypatch.setattr(ssdindex, "GROUP_OPS", 9)
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(4)
    tier.write_n(slots, HASHES[:4], _blocks(4))
    tier.free_n(slots[:2], HASHES[:2])
    db = tier.raw_db()
    assert not any(bytes(h) in db for h in HASHES[:4]) and tier.index.num_queued == 6
    tier.free_n(slots[2:3], HASHES[2:3])
    tier.write_n(tier.alloc_n(1), HASHES[4:5], _blocks(1, seed=1))
    assert tier.index.num_queued == 8 and not any(bytes(h) in db for h in HASHES[:5])
    tier.free_n([], [])
    tier.write_n(tier.alloc_n(1), HASHES[0:1], _blocks(1))  # freed above, stored again:
    assert tier.index.num_queued == 0  # the ninth, and the group is written
    assert [bytes(h) in db for h in HASHES[:5]] == [True, False, False, True, True]
    tier.write_n(tier.alloc_n(1), HASHES[5:6], _blocks(1, seed=5))
    tier.close()  # writes what is still queued
    tier = SsdTier(NS, str(tmp_path), 4)
    assert sorted(h for h, _ in tier.recover()) == sorted(HASHES[i] for i in (0, 3, 4, 5))
    assert tier.num_recovered_from_slabs == 0 and bytes(HASHES[2]) not in tier.raw_db().keys()
    tier.close()


def test_a_delete_cut_off_by_a_crash_leaves_a_stale_entry_that_loses_nothing(tmp_path):
    """Two entries naming one slot (the freed block's delete was still queued when the
    process died): the slot's header decides, whichever key RocksDB lists first."""
    from kvstore.fsck import fsck
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))
    tier.index.flush()
    stale = bytes(len(HASHES[0]))  # sorts before every real hash
    tier.raw_db()[stale] = tier.raw_db()[bytes(HASHES[0])]
    tier.raw_db()[b"\xff" * len(stale)] = tier.raw_db()[bytes(HASHES[1])]  # and after
    tier.close()
    report = fsck(str(tmp_path))
    assert report.num_ok == 2 and len(report.bad) == 2 and not report.clean
    assert all("stale entry" in reason for _, reason in report.bad)
    tier = SsdTier(NS, str(tmp_path), 4)
    found = dict(tier.recover())
    assert sorted(found) == sorted(HASHES[:2]) and tier.num_dropped_at_open == 2
    out = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[h] for h in HASHES[:2]], HASHES[:2], out) == [True, True]
    assert torch.equal(out, _blocks(2))
    tier.close()
    assert fsck(str(tmp_path)).clean


@pytest.mark.parametrize("group", [256, 5], ids=["nothing-written", "one-group-written"])
def test_a_crash_with_index_writes_queued_keeps_every_live_block(tmp_path, group):
    """SIGKILL with entries and deletes still queued (none written, or a first group of
    eight written and two queued after it): every block still stored is found, from its
    index entry or its header, and no freed one comes back."""
    _crash_after(tmp_path, 7, 6, f"""
        import kvstore.tiers.ssdindex as ssdindex
        ssdindex.GROUP_OPS = {group}
        slots = tier.alloc_n(4)
        tier.write_n(slots, hashes[:4], data[:4])
        tier.free_n(slots[:2], hashes[:2])          # queued: a free never writes
        tier.write_n(tier.alloc_n(2), hashes[4:6], data[4:6])  # the eighth op: with a
        tier.write_n(tier.alloc_n(1), hashes[6:7], data[6:7])  # group of 5, all written
        tier.free_n(slots[2:3], hashes[2:3])        # queued, never written
    """)
    tier = SsdTier(NS, str(tmp_path), 6)
    found = dict(tier.recover())
    data = _blocks(7)
    # block 2 was freed (its delete never written, its slot never reused): its header was
    # zeroed at the free, so it stays freed; every block still stored is kept
    live = [3, 4, 5, 6]
    assert sorted(found) == sorted(HASHES[i] for i in live)
    if group == 5:  # entries 2-5 written: 2 dropped (no header), 6 adopted from its header
        assert tier.num_dropped_at_open == 1 and tier.num_recovered_from_slabs == 1
    else:
        assert tier.num_dropped_at_open == 0 and tier.num_recovered_from_slabs == 4
    out = torch.zeros(len(live), NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[HASHES[i]] for i in live], [HASHES[i] for i in live], out) == \
        [True] * len(live)
    assert torch.equal(out, data[live])
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 6)  # the open wrote what it adopted into the index
    assert sorted(h for h, _ in tier.recover()) == sorted(HASHES[i] for i in live)
    assert tier.num_recovered_from_slabs == 0
    tier.close()


def test_fsck_counts_the_intact_blocks_a_killed_tier_had_not_indexed_yet(tmp_path):
    """After a SIGKILL with every entry still queued, fsck counts the intact blocks the
    index does not list and reports a damaged one (uncounted and unreported once); the
    next open adopts them and lists them."""
    _crash_after(tmp_path, 3, 4, "tier.write_n(tier.alloc_n(3), hashes[:3], data)")
    _flip(tmp_path / "slabs.dat", 2 * stride_of(NS.block_bytes) + 7)  # whichever block
    report = fsck(str(tmp_path))  # the damaged one is reported (a header is written after
    assert report.num_ok == 0 and report.num_recoverable == 2  # its payload: damage)
    assert len(report.bad) == 1 and "fails the checksum" in report.bad[0][1]
    tier = SsdTier(NS, str(tmp_path), 4)
    assert len(tier.recover()) == 3  # adopted by header; the damaged one fails its read
    tier.close()
    report = fsck(str(tmp_path))
    assert report.num_ok == 2 and len(report.bad) == 1 and report.num_recoverable == 0


def test_a_flipped_byte_on_disk_fails_verification(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))
    _flip(tmp_path / "slabs.dat", slots[0] * stride_of(NS.block_bytes) + 100)
    out = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(slots, HASHES[:2], out) == [False, True]
    tier.close()


def test_a_slot_read_under_another_hash_fails_and_a_bad_header_is_dropped_at_open(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))
    out = torch.zeros(1, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(slots[:1], HASHES[1:2], out) == [False]       # misplaced
    _flip(tmp_path / "headers.dat", slots[1] * HEADER_BYTES + 2)     # header magic broken
    # a read checks the payload against the checksum the tier holds: still intact
    assert tier.read_n(slots[1:], HASHES[1:2], out) == [True]
    assert torch.equal(out[0], _blocks(2)[1])
    tier.close()
    report = fsck(str(tmp_path))
    assert [h for h, _ in report.bad] == [bytes(HASHES[1])] and report.num_ok == 1
    tier = SsdTier(NS, str(tmp_path), 4)  # the header no longer vouches for it: dropped
    assert [h for h, _ in tier.recover()] == [bytes(HASHES[0])]
    assert tier.num_dropped_at_open == 1
    tier.close()


def test_an_index_entry_pointing_at_another_block_is_dropped_at_open(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))
    tier.index.flush()
    tier.raw_db()[bytes(HASHES[5])] = tier.raw_db()[bytes(HASHES[0])]  # a stale entry
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 4)
    assert sorted(h for h, _ in tier.recover()) == sorted(HASHES[:2])
    assert tier.num_dropped_at_open == 1 and bytes(HASHES[5]) not in tier.raw_db().keys()
    tier.close()


def test_reopen_with_less_capacity_drops_the_excess_and_foreign_keys(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 6)
    tier.write_n(tier.alloc_n(5), HASHES[:5], _blocks(5))
    tier.raw_db()[b"not-a-hash"] = b"junk"
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 3)
    assert len(tier.recover()) == 3 and tier.num_free() == 0
    assert tier.num_dropped_at_open == 3
    tier.close()
    assert os.path.getsize(tmp_path / "slabs.dat") == 3 * stride_of(NS.block_bytes)


def test_a_non_durable_tier_keeps_its_blocks_across_a_clean_close(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 4, durable=False)
    tier.write_n(tier.alloc_n(2), HASHES[:2], _blocks(2))
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 4, durable=False)
    found = dict(tier.recover())
    out = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[h] for h in HASHES[:2]], HASHES[:2], out) == [True, True]
    assert torch.equal(out, _blocks(2))
    tier.close()


def test_queued_index_writes_stay_bounded_while_the_index_refuses_writes(tmp_path, monkeypatch):
    """While RocksDB refuses every write, puts and frees go on (nothing fails: the headers
    hold the blocks) and the queue keeps at most QUEUE_KEEP ops; once writes go through, the
    next group carries what waited."""
    from kvstore.errors import TierIOError
    monkeypatch.setattr(ssdindex, "GROUP_OPS", 4)
    monkeypatch.setattr(ssdindex, "QUEUE_KEEP", 16)
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))

    def refuse(batch):  # RocksDB refusing every write (a full disk, a background error)
        raise TierIOError("refused")
    monkeypatch.setattr(tier.index, "_write", refuse)
    for i in range(40):  # frees keep coming while nothing can be written
        tier.free_n([], [bytes([i]) * len(HASHES[0])])
    tier.free_n(slots[:1], HASHES[:1])
    tier.write_n(tier.alloc_n(1), HASHES[2:3], _blocks(1, seed=2))  # does not fail
    assert tier.index.num_queued <= 16
    monkeypatch.undo()  # writes go through again: the next group carries what waited
    tier.persist_frees()
    assert tier.index.num_queued == 0 and bytes(HASHES[0]) not in tier.raw_db()
    assert bytes(HASHES[2]) in tier.raw_db()
    tier.close()


def test_payloads_sit_at_multiples_of_their_page_rounded_size():
    """Headers live apart so a power-of-two block lands at a multiple of its own size (the
    page cache keeps it in large folios); odd sizes round up to a page."""
    assert stride_of(1 << 20) == 1 << 20 and stride_of(4096) == 4096
    assert stride_of(NS.block_bytes) == 4096 and stride_of(13824) == 16384


def test_a_crash_between_a_payload_and_its_header_is_a_miss_not_wrong_kv(tmp_path):
    """A put into a reused slot dies after its payload is written and before its header:
    the old block's header and index entry remain over the new bytes. The old block then
    fails its checksum (a miss) and the new one was never indexed."""
    _crash_after(tmp_path, 2, 4, """
        slot = tier.alloc_n(1)
        tier.write_n(slot, hashes[:1], data[:1])
        tier.free_n(slot, hashes[:1])  # its index delete is still queued
        assert tier.alloc_n(1) == slot
        pwritev = os.pwritev
        def crash_at_the_header(fd, bufs, offset):
            if fd == tier.slabs.hfd:
                print("written", flush=True)
                os.kill(os.getpid(), 9)
            return pwritev(fd, bufs, offset)
        os.pwritev = crash_at_the_header
        native = slabfile._slabio
        def payload_then_crash(*args):  # (_slabio writes a run's headers in the same call,
            native.write_blocks(*args[:6])  # after its payloads: the payload alone, here)
            crash_at_the_header(tier.slabs.hfd, [], 0)
        if slabfile.NATIVE:
            import types
            slabfile._slabio = types.SimpleNamespace(write_blocks=payload_then_crash,
                                                     read_blocks=native.read_blocks)
        tier.write_n(slot, hashes[1:2], data[1:2])
    """)
    tier = SsdTier(NS, str(tmp_path), 4)
    found = dict(tier.recover())
    assert set(found) <= {bytes(HASHES[0])}  # the old entry, at most: its header is there
    out = torch.zeros(1, NS.block_bytes, dtype=torch.uint8)
    for h, slot in found.items():
        assert tier.read_n([slot], [h], out) == [False]  # its payload is another block's
    tier.close()


def test_a_header_file_cut_short_by_a_crash_loses_only_its_missing_slots(tmp_path):
    """The two files grow by separate fallocates: slots past the shorter are not used."""
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(3)
    tier.write_n(slots, HASHES[:3], _blocks(3))
    tier.close()
    os.truncate(tmp_path / "headers.dat", 2 * HEADER_BYTES)
    tier = SsdTier(NS, str(tmp_path), 4)
    found = dict(tier.recover())
    assert found == {bytes(h): s for h, s in zip(HASHES[:3], slots) if s < 2}
    fresh = tier.alloc_n(2)  # the files grow again, both
    tier.write_n(fresh, HASHES[5:7], _blocks(2, seed=1))
    out = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(fresh, HASHES[5:7], out) == [True, True]
    assert torch.equal(out, _blocks(2, seed=1))
    tier.close()


@pytest.mark.parametrize("layout", ["header-in-slot slab", "one-value-per-block",
                                    "header-in-slot slab, torn and another namespace's"])
def test_a_directory_of_an_older_layout_is_moved_aside_and_fsck_says_so(tmp_path, layout,
                                                                      caplog):
    path = tmp_path / "ssd"
    if layout == "one-value-per-block":
        db = Rdict(str(path))
        db[bytes(HASHES[0])] = b"an old block"
        db.close()
    else:  # the first slab layout: slabs.dat alone, each slot payload | header | pad (a
        # header torn by a crash, or of a namespace that reopened the directory, says so too)
        path.mkdir()
        other = Namespace("m-other", num_layers=2, num_kv_heads=2, head_dim=16,
                          dtype="float16", block_tokens=4)
        old_stride = -(-(NS.block_bytes + HEADER_BYTES) // 4096) * 4096
        with open(path / "slabs.dat", "wb") as f:
            for i, row in enumerate(_blocks(2)):
                payload = row.numpy().tobytes()
                header = encode_header(NS, HASHES[i], checksum(payload))
                if layout != "header-in-slot slab" and i == 0:
                    header = header[:20] + bytes(HEADER_BYTES - 20)  # torn
                elif layout != "header-in-slot slab":
                    header = encode_header(other, HASHES[i], checksum(payload))
                slot = payload + header
                f.write(slot + bytes(old_stride - len(slot)))
        layout = "header-in-slot slab"  # (what the log says)
        (path / "tier.json").write_text(json.dumps(dataclasses.asdict(NS)))
        with pytest.raises(ConfigError, match="older layout"):
            fsck(str(path))
    tier = SsdTier(NS, str(path), 4)
    assert tier.recover() == [] and tier.num_free() == 4
    aside = [p for p in os.listdir(tmp_path) if p.startswith("ssd.legacy-")]
    assert len(aside) == 1 and layout in caplog.text and aside[0] in caplog.text
    tier.close()
    assert fsck(str(path)).clean


def test_a_disk_that_refuses_to_grow_does_not_make_maintenance_evict_everything(tmp_path,
                                                                               monkeypatch):
    """A full disk leaves the tier no free slot for a while, yet it holds no more blocks:
    the watermarks count the slots in use, so the background pass keeps them (it used to
    take the ungrowable capacity for blocks and evict every one to reach the low mark)."""
    from kvstore.config import StoreConfig, TierConfig
    from kvstore.errors import TierIOError
    from kvstore.events import TierKind
    from kvstore.store import TieredStore

    ns = Namespace("grow", num_layers=1, num_kv_heads=1, head_dim=64)
    monkeypatch.setattr(slabfile, "EXTENT_BYTES", 8 * stride_of(ns.block_bytes))
    store = TieredStore(ns, StoreConfig((TierConfig(TierKind.SSD, 1000, path=str(tmp_path)),)))
    try:
        real_grow = slabfile.SlabFile.grow

        def grow(self, min_slots=1):
            if self.num_grown >= 24:  # the disk is full from here on
                raise TierIOError("no space left on device (simulated)")
            return real_grow(self, min_slots)

        monkeypatch.setattr(slabfile.SlabFile, "grow", grow)
        hashes = hash_blocks(ns, list(range(16 * 40)))
        rows = torch.randint(0, 256, (40, ns.block_bytes), dtype=torch.uint8)
        for i, h in enumerate(hashes):  # past 24 blocks a put makes room by dropping the oldest
            store.put_n([h], rows[i:i + 1])
        held = [i for i, hit in enumerate(store.contains_n(hashes)) if hit]
        assert len(held) == 24
        tier = store.stats().tier(TierKind.SSD)
        assert tier.used_blocks == 24 and tier.free_blocks == 0
        evicted = tier.counters.evictions
        store.maintain()
        out = torch.zeros_like(rows)
        got = store.get_n([hashes[i] for i in held], out[:len(held)])
        assert None not in got, "maintenance evicted blocks of a tier far below its watermark"
        assert torch.equal(out[:len(held)], rows[held])
        assert store.stats().tier(TierKind.SSD).counters.evictions == evicted
    finally:
        store.close(flush=False)


def test_a_rebuild_the_disk_has_no_room_for_leaves_the_index_in_place(tmp_path, monkeypatch):
    """The index refuses a write, will not reopen, and its rebuild fails for want of space
    (a full disk): the index it had stays where the next open reads it, so no block it
    acknowledged is lost (setting it aside before the rebuild left an empty index there:
    40 of 260 blocks survived in the probe that found it)."""
    import kvstore.tiers.ssdindex as ssdindex
    from kvstore.errors import TierIOError
    tier = SsdTier(NS, str(tmp_path), 8)
    tier.recover()
    tier.write_n(tier.alloc_n(4), HASHES[:4], _blocks(4))
    real_rdict, real_open = ssdindex.Rdict, ssdindex.SlotIndex._open_db

    def no_room(path, *args, **kw):
        if path.endswith(".new"):
            raise Exception("IO error: No space left on device")
        return real_rdict(path, *args, **kw)

    def will_not_open(self):
        raise Exception("IO error: No space left on device")
    monkeypatch.setattr(ssdindex, "Rdict", no_room)
    monkeypatch.setattr(ssdindex.SlotIndex, "_open_db", will_not_open)
    tier.index._failed_at = 0.0  # as after a refused write, its retry due: reopen, rebuild
    tier.write_n(tier.alloc_n(1), HASHES[4:5], _blocks(1, seed=4))  # queued: no index write
    with pytest.raises(TierIOError, match="cannot be rebuilt"):
        tier.index.flush()
    assert os.path.isfile(os.path.join(tier.index.path, "CURRENT"))
    assert not os.path.exists(tier.index.path + ".new")
    monkeypatch.setattr(ssdindex.SlotIndex, "_open_db", real_open)  # room again
    tier.index._failed_at = 0.0
    tier.write_n(tier.alloc_n(1), HASHES[5:6], _blocks(1, seed=5))
    tier.index.flush()  # reopens, writes what waited
    assert all(bytes(h) in tier.raw_db() for h in HASHES[:6])
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 8)
    assert set(h for h, _ in tier.recover()) == set(HASHES[:6])
    tier.close()


def test_a_freed_block_is_not_brought_back_by_an_index_rebuilt_from_the_headers(tmp_path):
    """Freeing a slot zeroes its header at once: its payload stays on disk until the slot
    is reused, yet an index rebuilt from the headers (lost, or damaged) does not adopt it."""
    import shutil
    tier = SsdTier(NS, str(tmp_path), 8)
    tier.recover()
    slots = tier.alloc_n(4)
    tier.write_n(slots, HASHES[:4], _blocks(4))
    tier.free_n([slots[1], slots[2]], HASHES[1:3])
    tier.persist_frees()
    tier.close()
    shutil.rmtree(tmp_path / "index")
    tier = SsdTier(NS, str(tmp_path), 8)
    found = dict(tier.recover())
    assert set(found) == {HASHES[0], HASHES[3]} and tier.num_recovered_from_slabs == 2
    out = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[HASHES[0]], found[HASHES[3]]], [HASHES[0], HASHES[3]], out) == \
        [True, True]
    assert torch.equal(out, _blocks(4)[[0, 3]])
    tier.close()


def test_a_second_header_of_a_block_found_is_zeroed_so_a_removed_block_stays_removed(
        tmp_path):
    """A slot whose header names a block the index already places elsewhere (a twin) is
    not adopted and its header is zeroed at open: freeing the block then leaves no header
    behind to bring it back at the next open."""
    tier = SsdTier(NS, str(tmp_path), 4)
    tier.recover()
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))
    tier.close()
    with open(tmp_path / "headers.dat", "r+b") as f:  # slot 2: a copy of slot 0's header
        f.seek(slots[0] * HEADER_BYTES)
        head = f.read(HEADER_BYTES)
        f.seek(2 * HEADER_BYTES)
        f.write(head)
    with open(tmp_path / "slabs.dat", "r+b") as f:  # and of its payload
        stride = stride_of(NS.block_bytes)
        f.seek(slots[0] * stride)
        body = f.read(NS.block_bytes)
        f.seek(2 * stride)
        f.write(body)
    tier = SsdTier(NS, str(tmp_path), 4)
    found = dict(tier.recover())
    assert found[HASHES[0]] == slots[0] and tier.num_recovered_from_slabs == 0
    with open(tmp_path / "headers.dat", "rb") as f:
        f.seek(2 * HEADER_BYTES)
        assert f.read(HEADER_BYTES) == bytes(HEADER_BYTES)
    tier.free_n([slots[0]], HASHES[:1])
    tier.persist_frees()
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 4)
    assert sorted(h for h, _ in tier.recover()) == [HASHES[1]]
    tier.close()


def test_an_index_that_is_gone_is_rebuilt_from_the_slab_headers(tmp_path):
    """An index directory deleted (or never synced) next to written slabs opens as a fresh,
    empty RocksDB with no error: the tier rebuilds it from the headers as it does a damaged
    one, instead of starting empty beside its own blocks."""
    import shutil
    tier = SsdTier(NS, str(tmp_path), 8)
    tier.recover()
    tier.write_n(tier.alloc_n(3), HASHES[:3], _blocks(3))
    tier.close()
    shutil.rmtree(tmp_path / "index")
    tier = SsdTier(NS, str(tmp_path), 8)
    found = dict(tier.recover())
    assert set(found) == set(HASHES[:3]) and tier.num_recovered_from_slabs == 3
    out = torch.zeros(3, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([found[h] for h in HASHES[:3]], HASHES[:3], out) == [True] * 3
    assert torch.equal(out, _blocks(3))
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 8)  # and the rebuilt index is the one read next time
    assert set(h for h, _ in tier.recover()) == set(HASHES[:3])
    assert tier.num_recovered_from_slabs == 0
    tier.close()


def test_an_index_missing_one_of_its_files_is_rebuilt_from_the_slab_headers(tmp_path):
    """RocksDB reports a deleted MANIFEST as an I/O error, not corruption: still the index's
    own damage, rebuilt from the headers (it used to keep the tier from opening at all)."""
    import glob
    tier = SsdTier(NS, str(tmp_path), 8)
    tier.recover()
    tier.write_n(tier.alloc_n(3), HASHES[:3], _blocks(3))
    tier.close()
    for manifest in glob.glob(str(tmp_path / "index" / "MANIFEST-*")):
        os.unlink(manifest)
    tier = SsdTier(NS, str(tmp_path), 8)
    assert set(h for h, _ in tier.recover()) == set(HASHES[:3])
    tier.close()


def test_tier_json_names_the_namespace_the_directory_was_last_opened_for(tmp_path):
    """fsck checks blocks against tier.json: a directory reopened for another namespace (its
    blocks of the first are dropped at open) must name the second, or a repair would drop
    every block the second wrote."""
    other = Namespace("other", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                      block_tokens=4)
    SsdTier(NS, str(tmp_path), 4).close()
    tier = SsdTier(other, str(tmp_path), 4)
    tier.recover()
    hs = hash_blocks(other, list(range(8)))
    tier.write_n(tier.alloc_n(2), hs, _blocks(2))
    tier.close()
    report = fsck(str(tmp_path))
    assert report.clean and report.num_ok == 2


@pytest.mark.parametrize("whose", ["this namespace's", "another namespace's"])
def test_blocks_that_begin_like_a_header_are_no_old_layout(tmp_path, caplog, whose):
    """The first layout kept each slot's header where a current tier keeps payload bytes
    (4 KiB blocks: the start of every odd slot). A tier whose headers.dat was lost, with
    a block there that began like a header (any namespace's: a tenant's own bytes), was
    taken for the first layout, set aside, and started empty. It is written again from
    its index, as any tier that lost its headers is."""
    ns = Namespace("m4k", num_layers=1, num_kv_heads=1, head_dim=64)  # 4 KiB blocks
    other = Namespace("m4k-other", num_layers=1, num_kv_heads=1, head_dim=64)
    assert ns.block_bytes == 4096
    hashes = hash_blocks(ns, list(range(16 * 8)))
    tier = SsdTier(ns, str(tmp_path / "ssd"), 8)
    slots = tier.alloc_n(6)
    data = torch.randint(0, 256, (6, ns.block_bytes), dtype=torch.uint8)
    for row in data:
        row[:HEADER_BYTES] = torch.frombuffer(bytearray(encode_header(
            ns if whose.startswith("this") else other, hashes[7], 0)), dtype=torch.uint8)
    tier.write_n(slots, hashes[:6], data)
    tier.close()
    assert (tmp_path / "ssd" / "layout").exists()  # (what says so, whatever the bytes)
    os.unlink(tmp_path / "ssd" / "headers.dat")
    tier = SsdTier(ns, str(tmp_path / "ssd"), 8)
    assert dict(tier.recover()) == {bytes(h): s for h, s in zip(hashes[:6], slots)}
    out = torch.zeros(6, ns.block_bytes, dtype=torch.uint8)
    assert tier.read_n(slots, hashes[:6], out) == [True] * 6 and torch.equal(out, data)
    assert not [p for p in os.listdir(tmp_path) if ".legacy-" in p]
    tier.close()


def test_a_lost_header_file_is_written_again_from_the_index(tmp_path, caplog):
    """headers.dat deleted (or lost with a damaged disk) beside an intact slabs.dat and
    index: fsck says so, and the next open writes the headers again from the index, every
    block found byte-exact. It was taken for the first layout, and the whole tier was set
    aside (every block a miss)."""
    tier = SsdTier(NS, str(tmp_path), 8)
    slots = tier.alloc_n(5)
    tier.write_n(slots, HASHES[:5], _blocks(5))
    tier.free_n(slots[4:], HASHES[4:5])  # removed: must stay gone
    tier.close()
    os.unlink(tmp_path / "headers.dat")
    report = fsck(str(tmp_path))
    assert not report.clean and "headers.dat is missing" in report.index_error
    assert "4 entries" in report.index_error and not (tmp_path / "headers.dat").exists()
    holder = Rdict(str(tmp_path / "index"))  # an open that fails before the headers are
    try:  # back (the index locked by another): nothing changes on disk, the next retries
        with pytest.raises(TierIOError):
            SsdTier(NS, str(tmp_path), 8)
    finally:
        holder.close()
    assert not (tmp_path / "headers.dat").exists()
    tier = SsdTier(NS, str(tmp_path), 8)
    found = dict(tier.recover())
    assert found == {bytes(h): s for h, s in zip(HASHES[:4], slots)}
    out = torch.zeros(4, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(slots[:4], HASHES[:4], out) == [True] * 4
    assert torch.equal(out, _blocks(5)[:4]) and "written again" in caplog.text
    assert not [p for p in os.listdir(tmp_path.parent) if ".legacy-" in p]
    tier.close()
    assert fsck(str(tmp_path)).clean


def test_a_header_whose_hash_field_is_damaged_serves_no_key_nobody_put(tmp_path):
    """A flipped bit in a header's block hash: the index's entry (same slot, the checksum
    the header carries) stands and the header is written again. Before, the entry was
    dropped as stale and the slot adopted under the damaged hash: a hit for a key never
    put, and fsck counted it intact."""
    tier = SsdTier(NS, str(tmp_path), 4)
    slots = tier.alloc_n(2)
    tier.write_n(slots, HASHES[:2], _blocks(2))
    tier.close()
    with open(tmp_path / "headers.dat", "rb") as f:
        f.seek(slots[1] * HEADER_BYTES)
        at = slots[1] * HEADER_BYTES + f.read(HEADER_BYTES).index(bytes(HASHES[1]))
    _flip(tmp_path / "headers.dat", at + 3)
    wrong = _header(tmp_path, slots[1]).block_hash
    assert wrong != HASHES[1]
    report = fsck(str(tmp_path))
    assert [reason for _, reason in report.bad] == [
        f"slot {slots[1]}'s header names another block but holds this entry's checksum: "
        "the header is damaged; the next start or --repair writes it again"]
    assert report.num_recoverable == 0
    tier = SsdTier(NS, str(tmp_path), 4)
    assert dict(tier.recover()) == {bytes(h): s for h, s in zip(HASHES[:2], slots)}
    out = torch.zeros(2, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(slots, HASHES[:2], out) == [True, True] and torch.equal(out, _blocks(2))
    assert tier.locate(wrong) is None
    tier.close()
    assert _header(tmp_path, slots[1]).block_hash == HASHES[1] and fsck(str(tmp_path)).clean


def test_a_block_of_the_same_bytes_put_where_a_freed_one_was_is_kept_at_reopen(tmp_path):
    """Block A freed (its delete still queued), X of the same bytes under another hash (the
    same prompt under two salts) put into A's slot, then death with X's entry unwritten:
    X, acknowledged, is found from its header, and A stays gone. A header is read as a
    damaged copy of the entry's hash only when the two are a few bits apart."""
    from kvstore.tiers.ssd import damaged_copy
    a, x = HASHES[0], hash_blocks(NS, list(range(4)), extra=b"salt2")[0]
    assert not damaged_copy(a, x) and damaged_copy(a, bytes([a[0] ^ 1]) + a[1:])
    data = torch.full((1, NS.block_bytes), 7, dtype=torch.uint8)
    tier = SsdTier(NS, str(tmp_path), 4)
    slot = tier.alloc_n(1)
    tier.write_n(slot, [a], data)
    tier.index.flush()
    tier.free_n(slot, [a])
    assert tier.alloc_n(1) == slot  # (the last freed slot goes first)
    tier.write_n(slot, [x], data)
    tier._closed = True  # SIGKILL: nothing queued written (A's delete, X's entry)
    tier.index._queue.clear()
    tier.index._db.close()
    tier.index._db = None
    tier.slabs.close()
    tier = SsdTier(NS, str(tmp_path), 4)
    assert dict(tier.recover()) == {bytes(x): slot[0]}
    tier.close()


def test_old_headers_past_a_shortened_slab_file_never_come_back_as_phantoms(tmp_path):
    """slabs.dat cut short (on disk, or a crash inside truncate_to): the slots past it are
    gone, and so must their headers be. Left in headers.dat, the next extent's
    posix_fallocate kept them (it zeroes nothing already written), the open after adopted
    them, and a put of those blocks answered EXISTS with their bytes gone."""
    hs = hash_blocks(NS, list(range(4 * 41)))
    tier = SsdTier(NS, str(tmp_path), 40)
    tier.recover()
    tier.write_n(tier.alloc_n(40), hs[:40], _blocks(40))
    tier.close()
    os.truncate(tmp_path / "slabs.dat", 20 * stride_of(NS.block_bytes))
    tier = SsdTier(NS, str(tmp_path), 40)
    assert len(tier.recover()) == 20
    assert os.path.getsize(tmp_path / "headers.dat") == 20 * HEADER_BYTES
    tier.write_n(tier.alloc_n(1), hs[40:], _blocks(1, seed=9))  # grows both files again
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 40)
    try:
        assert len(tier.recover()) == 21
    finally:
        tier.close()


def test_an_index_path_that_is_not_a_directory_is_set_aside_and_rebuilt(tmp_path):
    tier = SsdTier(NS, str(tmp_path), 8)
    tier.recover()
    tier.write_n(tier.alloc_n(3), HASHES[:3], _blocks(3))
    tier.close()
    subprocess.run(["rm", "-rf", str(tmp_path / "index")], check=True)
    (tmp_path / "index").write_bytes(b"not rocksdb")
    assert "not a directory" in fsck(str(tmp_path)).index_error
    tier = SsdTier(NS, str(tmp_path), 8)
    try:
        assert sorted(h for h, _ in tier.recover()) == sorted(HASHES[:3])
        assert tier.index.damaged
    finally:
        tier.close()
    assert fsck(str(tmp_path)).clean


def test_fsck_reports_a_missing_slab_file_and_does_not_create_it(tmp_path):
    """A slab file gone beside its headers is reported, not created empty by the check
    (which then reported the tier clean, every block gone)."""
    tier = SsdTier(NS, str(tmp_path), 8)
    tier.recover()
    tier.write_n(tier.alloc_n(3), HASHES[:3], _blocks(3))
    tier.close()
    assert fsck(str(tmp_path)).num_ok == 3
    os.unlink(tmp_path / "slabs.dat")
    report = fsck(str(tmp_path))
    assert not report.clean and "slabs.dat is missing" in report.index_error
    assert len(report.bad) == 3 and not (tmp_path / "slabs.dat").exists()


def test_one_unreadable_spot_fails_only_its_own_blocks_of_a_batched_read(tmp_path):
    """Blocks read in one preadv per run: a spot that will not read (here the file cut
    short under a running tier, as a bad sector would fail) failed the whole run, and the
    intact blocks beside it were misses too (dropped as damaged by the store). Now each
    block of a failed run is read on its own: only the ones past the cut miss."""
    hs = hash_blocks(NS, list(range(4 * 40)))
    data = _blocks(40)
    tier = SsdTier(NS, str(tmp_path), 40)
    try:
        tier.recover()
        slots = tier.alloc_n(40)
        tier.write_n(slots, hs, data)
        cut = sorted(slots)[30]
        os.truncate(tmp_path / "slabs.dat", cut * stride_of(NS.block_bytes))
        out = torch.zeros_like(data)
        ok = tier.read_n(slots, hs, out)
        assert ok == [s < cut for s in slots] and any(ok) and not all(ok)
        for i, good in enumerate(ok):
            if good:
                assert torch.equal(out[i], data[i])
    finally:
        tier.close()


def test_a_block_adopted_from_its_header_keeps_the_index_entry_it_gets_at_open(tmp_path):
    """A block freed, put again into another slot, and the process killed before the index
    heard of either: the next open drops the stale entry (its slot's header is zeroed) and
    adopts the block from its new slot's header. The adopted entry was queued first and
    the stale key's delete after it, in one write: the block lost its entry, and fsck
    then said it waited for an entry from a tier that had closed cleanly."""
    script = textwrap.dedent(f"""
        import os, torch
        from kvstore.keys import Namespace, hash_blocks
        from kvstore.tiers import slabfile
        from kvstore.tiers.ssd import SsdTier
        slabfile.NATIVE = {slabfile.NATIVE!r}
        NS = Namespace(**{dataclasses.asdict(NS)!r})
        t = SsdTier(NS, {str(tmp_path)!r}, 8)
        t.recover()
        a = hash_blocks(NS, list(range(4)))[0]
        data = torch.full((1, NS.block_bytes), 7, dtype=torch.uint8)
        s0, s1 = t.alloc_n(2)
        t.write_n([s0], [a], data)
        t.index.flush()          # a -> s0, written
        t.free_n([s0], [a])      # its header zeroed, its delete queued
        t.write_n([s1], [a], data)  # put again into s1: its entry queued
        os._exit(0)              # killed before the queue was written
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))))
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root)
    a = bytes(hash_blocks(NS, list(range(4)))[0])
    tier = SsdTier(NS, str(tmp_path), 8)
    assert [h for h, _ in tier.recover()] == [a]
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 8)
    try:
        assert a in tier.raw_db()
    finally:
        tier.close()
    assert fsck(str(tmp_path)).num_recoverable == 0


def test_a_lost_header_file_waits_for_an_index_that_cannot_open_for_want_of_space(
        tmp_path, monkeypatch):
    """headers.dat lost, and RocksDB unable to open the index (no disk space: it writes at
    every open): the headers cannot be written again from the index now, and written from
    nothing they would say every slot is free (the blocks lost, their slots reused). The
    open fails, headers.dat stays missing, and the next open with room restores it."""
    hs = hash_blocks(NS, list(range(4 * 8)))
    tier = SsdTier(NS, str(tmp_path), 8)
    tier.recover()
    tier.write_n(tier.alloc_n(8), hs, _blocks(8))
    tier.close()
    os.unlink(tmp_path / "headers.dat")

    def full(self):
        raise Exception("IO error: While appending to file: No space left on device")
    with monkeypatch.context() as m:
        m.setattr(ssdindex.SlotIndex, "_open_db", full)
        with pytest.raises(TierIOError, match="no disk space"):
            SsdTier(NS, str(tmp_path), 8)
    assert not os.path.exists(tmp_path / "headers.dat")
    tier = SsdTier(NS, str(tmp_path), 8)
    try:
        assert sorted(h for h, _ in tier.recover()) == sorted(hs)
    finally:
        tier.close()


def test_an_index_that_cannot_open_for_want_of_space_serves_from_the_headers(tmp_path,
                                                                            monkeypatch):
    """The index cannot open (no space): the tier opens all the same, its blocks found from
    the slab headers and read intact, and the index is written once it opens again."""
    hs = hash_blocks(NS, list(range(4 * 8)))
    data = _blocks(8)
    tier = SsdTier(NS, str(tmp_path), 8)
    tier.recover()
    slots = tier.alloc_n(8)
    tier.write_n(slots, hs, data)
    tier.close()
    real = ssdindex.SlotIndex._open_db

    def full(self):
        raise Exception("IO error: While appending to file: No space left on device")
    monkeypatch.setattr(ssdindex.SlotIndex, "_open_db", full)
    tier = SsdTier(NS, str(tmp_path), 8)
    try:
        found = dict(tier.recover())
        assert sorted(found) == sorted(hs)
        out = torch.zeros_like(data)
        assert tier.read_n([found[h] for h in hs], hs, out) == [True] * 8
        assert torch.equal(out, data[[slots.index(found[h]) for h in hs]])
        monkeypatch.setattr(ssdindex.SlotIndex, "_open_db", real)
        monkeypatch.setattr(ssdindex, "RETRY_S", 0.0)
        tier.index.flush()  # room again: opened and written
        assert all(bytes(h) in tier.raw_db() for h in hs)
    finally:
        tier.close()


def test_a_header_read_the_disk_refuses_at_open_is_an_error_not_an_empty_tier(tmp_path,
                                                                             monkeypatch):
    """An EIO reading headers.dat at open was taken for "no header there": the open then
    dropped every index entry of those slots (deleted from the index) and freed them, a
    whole tier lost to one transient error. The open fails instead (the namespace is not
    served for now, its files untouched), and the next one finds every block."""
    import errno
    tier = SsdTier(NS, str(tmp_path), 8)
    slots = tier.alloc_n(5)
    tier.write_n(slots, HASHES[:5], _blocks(5))
    tier.close()
    real = os.pread

    def failing(fd, n, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("headers.dat"):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, offset)
    monkeypatch.setattr(os, "pread", failing)
    tier = SsdTier(NS, str(tmp_path), 8)
    with pytest.raises(TierIOError, match="cannot be read"):
        tier.recover()
    tier.close()
    monkeypatch.setattr(os, "pread", real)
    tier = SsdTier(NS, str(tmp_path), 8)
    assert dict(tier.recover()) == {bytes(h): s for h, s in zip(HASHES[:5], slots)}
    out = torch.zeros(5, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(slots, HASHES[:5], out) == [True] * 5 and torch.equal(out, _blocks(5))
    assert tier.num_dropped_at_open == 0
    tier.close()


@pytest.mark.parametrize("winner", ["first", "second"])
def test_two_writes_of_one_hash_keep_the_one_published(tmp_path, winner):
    """Two puts of one block may each write a slot (kvstore.tiermap.claim): the slot
    published holds the hash, the other's is freed, and neither undoes the other (the free
    of the loser's slot forgot the hash, index entry and all, when the tier was keyed by
    hash alone). The index says so after a reopen, with nothing left to adopt."""
    tier = SsdTier(NS, str(tmp_path), 8)
    a, b = tier.alloc_n(2)
    data = _blocks(1)
    tier.write_n([a], HASHES[:1], data)
    tier.write_n([b], HASHES[:1], data)
    keep, lose = (a, b) if winner == "first" else (b, a)
    tier.publish_n([keep], HASHES[:1])
    tier.free_n([lose], HASHES[:1])
    out = torch.zeros(1, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n([keep], HASHES[:1], out) == [True] and torch.equal(out, data)
    assert tier.read_n([lose], HASHES[:1], out) == [False]
    tier.close()
    tier = SsdTier(NS, str(tmp_path), 8)
    assert tier.recover() == [(bytes(HASHES[0]), keep)]
    assert tier.num_recovered_from_slabs == 0 and tier.num_dropped_at_open == 0
    tier.close()


def test_a_header_whose_checksum_field_is_damaged_keeps_its_intact_block(tmp_path):
    """The header's checksum won over the index's at open: one flipped bit in that field
    made an intact block a miss. The payload decides (read once, at open): the index's
    checksum stands where the payload has it, and the header is written again."""
    tier = SsdTier(NS, str(tmp_path), 8)
    slots = tier.alloc_n(3)
    tier.write_n(slots, HASHES[:3], _blocks(3))
    tier.close()
    a, b = encode_header(NS, HASHES[1], 0), encode_header(NS, HASHES[1], (1 << 64) - 1)
    field = next(i for i in range(HEADER_BYTES) if a[i] != b[i])  # (the checksum's first byte)
    _flip(tmp_path / "headers.dat", slots[1] * HEADER_BYTES + field)
    tier = SsdTier(NS, str(tmp_path), 8)
    assert dict(tier.recover()) == {bytes(h): s for h, s in zip(HASHES[:3], slots)}
    out = torch.zeros(3, NS.block_bytes, dtype=torch.uint8)
    assert tier.read_n(slots, HASHES[:3], out) == [True] * 3 and torch.equal(out, _blocks(3))
    assert _header(tmp_path, slots[1]).checksum == checksum(_blocks(3)[1].numpy().tobytes())
    tier.close()
    assert fsck(str(tmp_path)).clean
