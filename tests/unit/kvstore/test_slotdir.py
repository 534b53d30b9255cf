"""The DRAM arena's slot directory: what a same-host reader may copy with no request."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.config import StoreConfig, TierConfig
from kvstore.errors import ConfigError
from kvstore.events import TierKind
from kvstore import slotdir
from kvstore.keys import Namespace, hash_blocks
from kvstore.store import TieredStore
from kvstore.slotdir import (ALIVE_CHECK_S, PROBES, SlotDirectory, SlotDirectoryReader,
                             entry)

NS = Namespace("slotdir-test", num_layers=1, num_kv_heads=1, head_dim=16)  # 1 KiB blocks


@pytest.fixture(autouse=True, params=["c", "python"])
def loops(request, monkeypatch):
    """Every test here runs with the directory's loops in C (kvstore/_slotdir.c, built by
    this install) and in Python (an install without a C compiler)."""
    if request.param == "c":
        assert slotdir._slotdir is not None, "kvstore._slotdir is not built: reinstall " \
                                            "kvtier with a C compiler (pip install -e .)"
    else:
        monkeypatch.setattr(slotdir, "_slotdir", None)
    return request.param


@pytest.fixture
def pair():
    writer = SlotDirectory(32)
    reader = SlotDirectoryReader(writer.share_fd(), 32)
    yield writer, reader
    reader.close()
    writer.close()


def h(i: int, bucket: int | None = None) -> bytes:
    """A 16-byte hash; with `bucket`, one whose table bucket is forced (same low bits)."""
    low = (bucket if bucket is not None else i * 2654435761) & 0xFFFFFFFF
    return low.to_bytes(8, "little") + i.to_bytes(8, "little")


def test_publish_find_unpublish(pair):
    writer, reader = pair
    assert reader.find(h(1)) is None
    writer.publish([5], [h(1)])
    slot, gen = reader.find(h(1))
    assert slot == 5 and gen % 2 == 0 and reader.still_valid(5, gen)
    assert reader.find(h(2)) is None
    writer.unpublish([5], [h(1)])
    assert reader.find(h(1)) is None
    assert not reader.still_valid(5, gen), "a copy made before the unpublish must be refused"
    writer.publish([5], [h(2)])  # the slot is reused for another block
    assert reader.find(h(1)) is None
    slot, gen2 = reader.find(h(2))
    assert slot == 5 and gen2 != gen and not reader.still_valid(5, gen)


def test_unpublishing_a_never_published_slot_changes_nothing(pair):
    writer, reader = pair
    writer.publish([3], [h(3)])
    _, gen = reader.find(h(3))
    writer.unpublish([4], [h(4)])  # a reservation given back
    assert reader.find(h(3)) == (3, gen)


def test_a_crowded_bucket_only_loses_hints(pair):
    writer, reader = pair
    keys = [h(i, bucket=7) for i in range(PROBES + 3)]
    writer.publish(list(range(len(keys))), keys)
    found = {i: reader.find(k) for i, k in enumerate(keys)}
    assert sum(f is not None for f in found.values()) == PROBES
    for i, f in found.items():  # whatever is found is right
        assert f is None or f[0] == i
    lost = [i for i, f in found.items() if f is None]
    kept = [i for i, f in found.items() if f is not None]
    writer.unpublish([kept[0]], [keys[kept[0]]])
    writer.unpublish([lost[0]], [keys[lost[0]]])
    writer.publish([lost[0]], [keys[lost[0]]])
    assert reader.find(keys[lost[0]])[0] == lost[0]
    assert reader.find(keys[kept[0]]) is None


def test_a_garbage_table_entry_is_never_trusted(pair):
    writer, reader = pair
    writer.publish([9], [h(9)])
    # point every bucket at slot 9 (what a torn or stale table could show), under the tag
    # of the hash looked up: the tag lets a reader look, the slot's owner decides
    table = writer._v.table
    for key in (h(9), h(10)):
        for i in range(len(table)):
            table[i] = entry(9, key)
        assert reader.find(h(9)) is None or key == h(9)
        assert reader.find(h(10)) is None, "slot 9 holds another hash"
        got, _ = reader.find_n(h(9) + h(10))
        assert got.tolist() == ([9, -1] if key == h(9) else [-1, -1])
    table[0] = entry(10 ** 6, h(0, bucket=0))  # out of range
    assert reader.find(h(0, bucket=0)) is None
    table[0] = -1  # not an entry at all
    assert reader.find(h(0, bucket=0)) is None
    assert reader.find_n(h(0, bucket=0))[0].tolist() == [-1]


def test_only_entries_with_the_hash_tag_are_looked_into(pair):
    """A miss looks no further than the tags of the entries in its probes; a hit is
    found among entries of other hashes in the same buckets."""
    writer, reader = pair
    keys = [h(i, bucket=3) for i in range(PROBES - 1)]
    writer.publish(list(range(len(keys))), keys)
    assert [reader.find(k)[0] for k in keys] == list(range(len(keys)))
    assert reader.find_n(b"".join(keys))[0].tolist() == list(range(len(keys)))
    # an entry for slot 0 under another hash's tag: slot 0's owner is never compared
    gen = writer._v.gen
    owner_checked = []
    class Spy(bytes):
        def __eq__(self, other):
            owner_checked.append(other)
            return bytes.__eq__(self, other)
        __hash__ = bytes.__hash__
    assert reader.find(Spy(h(99, bucket=3))) is None
    assert owner_checked == [], "a miss compared owners of entries with other tags"
    assert gen[0] % 2 == 0


def test_wrapping_probes_are_found(pair):
    """Buckets at the end of the table probe on from its start."""
    writer, reader = pair
    last = writer._v.table_size - 1
    keys = [h(i, bucket=last) for i in range(4)]
    writer.publish([1, 2, 3, 4], keys)
    assert [reader.find(k)[0] for k in keys] == [1, 2, 3, 4]
    assert reader.find_n(b"".join(keys))[0].tolist() == [1, 2, 3, 4]
    writer.unpublish([2], [keys[1]])
    assert reader.find(keys[1]) is None and reader.find(keys[3])[0] == 4


def test_closed_directory_finds_nothing(pair):
    writer, reader = pair
    writer.publish([1], [h(1)])
    _, gen = reader.find(h(1))
    writer.close()
    assert reader.closed and reader.find(h(1)) is None and not reader.still_valid(1, gen)
    assert not reader.writer_alive()


def test_reader_checks_what_it_maps(tmp_path):
    writer = SlotDirectory(8)
    try:
        with pytest.raises(ConfigError, match="slot directory"):
            SlotDirectoryReader(writer.share_fd(), 16)
    finally:
        writer.close()
    bogus = tmp_path / "x.dir"
    bogus.write_bytes(b"\0" * 4096)
    with pytest.raises(ConfigError):
        SlotDirectoryReader(os.open(bogus, os.O_RDONLY), 8)


def test_a_reader_can_neither_write_nor_map_the_directory_writable():
    import mmap
    writer = SlotDirectory(8)
    fd = writer.share_fd()
    try:
        with pytest.raises(OSError):
            os.write(fd, b"x")
        with pytest.raises(OSError):  # not even after reopening it read-write
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                mmap.mmap(rw, os.fstat(rw).st_size, mmap.MAP_SHARED,
                          mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(rw)
        with pytest.raises(OSError):  # nor shrink it under the writer
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
        writer.close()


def _dram_store(tmp_path, dram: int, ssd: int = 0) -> TieredStore:
    tiers = [TierConfig(TierKind.DRAM, dram)]
    if ssd:
        tiers.append(TierConfig(TierKind.SSD, ssd, path=str(tmp_path / "ssd")))
    return TieredStore(NS, StoreConfig(tuple(tiers)))


def _visible_in_directory(store: TieredStore, reader: SlotDirectoryReader) -> dict[bytes, int]:
    arena = store.tier(TierKind.DRAM).arena
    out = {}
    for key in store.list_hashes():
        f = reader.find(key)
        if f is not None:
            out[key] = f[0]
            assert np.array_equal(arena[f[0]], BLOCKS[key]), "the directory points at "\
                "a slot holding other bytes"
    return out


BLOCKS: dict[bytes, np.ndarray] = {}


def test_the_store_publishes_exactly_its_readable_dram_blocks(tmp_path):
    """Puts publish, evictions to SSD / drops / removes unpublish, a hit promoted back from
    SSD is published at its new slot; never a reserved, uncommitted block."""
    store = _dram_store(tmp_path, dram=4, ssd=16)
    d = store.tier(TierKind.DRAM).directory
    reader = SlotDirectoryReader(d.share_fd(), 4)
    try:
        hashes = hash_blocks(NS, np.arange(10 * NS.block_tokens))
        rng = np.random.default_rng(0)
        for key in hashes:
            BLOCKS[key] = rng.integers(0, 256, NS.block_bytes, np.uint8)
        res = store.reserve_n(hashes[:2])
        assert reader.find(hashes[0]) is None, "reserved, not committed: not readable"
        store.write_reserved(res, [BLOCKS[k] for k in hashes[:2]])
        assert reader.find(hashes[0]) is None
        store.commit(res.reservation_id)
        assert set(_visible_in_directory(store, reader)) == set(hashes[:2])
        store.put_n(hashes[2:10], [BLOCKS[k] for k in hashes[2:10]])  # 6 demoted to SSD
        in_dram = {k for k in hashes if store.match_prefix([k]).tiers == (TierKind.DRAM,)}
        assert len(in_dram) == 4 and set(_visible_in_directory(store, reader)) == in_dram
        ssd_key = next(k for k in hashes if k not in in_dram)
        out = np.empty(NS.block_bytes, np.uint8)
        assert store.get_n([ssd_key], [out]) == [TierKind.SSD]  # promoted on the hit
        assert ssd_key in _visible_in_directory(store, reader)
        some = next(iter(_visible_in_directory(store, reader)))
        store.remove_n([some])
        assert reader.find(some) is None
        store.clear()
        assert _visible_in_directory(store, reader) == {}
    finally:
        reader.close()
        store.close()


def test_a_dead_writer_is_seen_at_once(tmp_path):
    """SIGKILL leaves published blocks mapped in every reader; the flock tells them."""
    import signal
    import subprocess
    import sys
    import time

    code = ("import os, sys, time; from kvstore.slotdir import SlotDirectory; "
            "d = SlotDirectory(8); d.publish([2], [bytes(range(16))]); "
            "print(os.getpid(), d.share_fd(), flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid, fd = child.stdout.readline().split()
        reader = SlotDirectoryReader(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY), 8)
        assert reader.writer_alive() and reader.find(bytes(range(16)))[0] == 2
        child.send_signal(signal.SIGKILL)
        child.wait()
        time.sleep(ALIVE_CHECK_S)  # the lock is probed at most this often
        assert not reader.writer_alive()
        reader.close()
    finally:
        child.kill()
        child.wait()


def test_batched_lookup_agrees_with_single_lookups(pair):
    """find_n / still_valid_n against find / still_valid over random publish / unpublish
    churn, crowded buckets included."""
    writer, reader = pair
    rng = np.random.default_rng(3)
    keys = [h(i, bucket=int(rng.integers(0, 4)) if i % 3 == 0 else None) for i in range(200)]
    where: dict[int, int] = {}  # slot -> key index
    for _ in range(300):
        slot = int(rng.integers(0, 32))
        if slot in where:
            writer.unpublish([slot], [keys[where.pop(slot)]])
        else:
            k = int(rng.integers(0, 200))
            if k not in where.values():
                writer.publish([slot], [keys[k]])
                where[slot] = k
        probe = [keys[int(i)] for i in rng.integers(0, 200, 12)]
        slots, gens = reader.find_n(b"".join(probe))
        for key, slot, gen in zip(probe, slots.tolist(), gens.tolist()):
            single = reader.find(key)
            assert (single or (-1, 0)) == ((slot, gen) if slot >= 0 else (-1, 0))
        found = slots >= 0
        assert reader.still_valid_n(slots[found], gens[found]).all()


def test_stores_leave_nothing_in_dev_shm_however_they_end(tmp_path):
    """Arenas, directories and staging memory are anonymous: a store that exits without
    close() or is SIGKILLed leaves no file behind for anyone to find or sweep."""
    import subprocess
    import sys

    before = set(os.listdir("/dev/shm"))
    for end in ("pass", "os.kill(os.getpid(), signal.SIGKILL)"):
        code = ("import os, signal; from kvstore.tiers.dram import DramTier; "
                f"t = DramTier(4, 1024); print('made', flush=True); {end}")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
        assert "made" in done.stdout, done.stderr
    assert set(os.listdir("/dev/shm")) <= before


def test_an_arena_the_system_will_not_map_writable_means_inline_blocks(caplog):
    """A client that cannot map SHARE's arena writable (another process sealed it, before
    the daemon made its seals final) goes on without it, blocks inline, with a warning."""
    from kvstore import wire as w
    from kvstore.client.shm import open_arena
    from transfer.shm import ShmSegment
    seg = ShmSegment.anonymous(8192, "test-arena", final=False)
    try:
        seg.seal_writes()
        arena_fd, dir_fd = seg.share_fd(writable=True), seg.share_fd(writable=False)
        assert open_arena(w.ShareOk(), arena_fd, dir_fd, 4096) is None
        assert "inline" in caplog.text
        for fd in (arena_fd, dir_fd):  # both were closed
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        seg.close()

