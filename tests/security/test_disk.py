"""A full disk and a damaged one, for real: a small tmpfs as the data dir, flipped bytes in
the slab file and in RocksDB's SST files. A put that could not store says NO_SPACE (never a
later phantom EXISTS), the daemon recovers once space returns and stops cleanly on a full
disk; corruption is a miss or a rebuilt index, never an outage or wrong bytes."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore import Client
from kvstore.events import TierKind
from kvstore.keys import hash_blocks
from kvstore.store import PutStatus
from kvstore.tiers.slabfile import stride_of

from .conftest import NS, ROOT, block_of, metric, wait_for

BB = NS.block_bytes


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs mounted for this test (needs root, as CI has)."""
    if os.geteuid() != 0:
        pytest.fail("mounting a small tmpfs needs root (CI runs as root)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt, leave_bytes: int) -> str:
    """Fill the disk but `leave_bytes`; returns the filler's path (delete it to make room)."""
    filler = os.path.join(mnt, "filler")
    st = os.statvfs(mnt)
    size = st.f_bavail * st.f_frsize - leave_bytes
    with open(filler, "wb") as f:
        f.write(b"\0" * max(size, 0))
    return filler


def blocks(hs):
    return np.stack([block_of(h, BB) for h in hs])


def test_a_full_disk_is_no_space_never_exists_and_recovers(make_daemon, small_disk):
    d = make_daemon("--token-file", _tokens(small_disk), "--dram-size", "0",
                    data_dir=str(small_disk / "data"), ssd_size="64MiB")
    with Client(d.url, "admin-secret", NS, use_shm=False) as c:
        assert wait_for(lambda: "but its disk has" in d.output()), "no warning at start"
        filler = fill(small_disk, (1 << 20) + (256 << 10))  # 1 MiB kept for the index:
        # ~50 slots of 4 KiB (and their headers) left for blocks, fewer than a retry asks
        first = hash_blocks(NS, np.arange(8 * 16))
        assert c.put_n(first, blocks(first)) == [PutStatus.STORED] * 8, d.output()
        more = hash_blocks(NS, np.arange(128 * 16) + 10 ** 6)
        statuses = c.put_n(more, blocks(more))
        lost = [h for h, st in zip(more, statuses) if st is PutStatus.NO_SPACE]
        assert lost, "the disk never filled"
        assert set(statuses) <= {PutStatus.STORED, PutStatus.NO_SPACE}
        again = c.put_n(lost, blocks(lost))  # the retry a client makes: still not stored
        assert PutStatus.EXISTS not in again
        lost = [h for h, st in zip(lost, again) if st is PutStatus.NO_SPACE]
        assert lost and c.contains_n(lost) == [False] * len(lost)
        out = np.zeros((len(lost), BB), np.uint8)
        assert c.get_n(lost, out) == [None] * len(lost)
        held = [h for h in first + more if c.contains_n([h])[0]]  # the rest were evicted (LRU)
        got = np.zeros((len(held), BB), np.uint8)  # whatever it holds, it holds intact
        assert held and c.get_n(held, got) == [TierKind.SSD] * len(held)
        assert np.array_equal(got, blocks(held))
        os.unlink(filler)  # room again: puts are stored (after the tier's retry pause)
        assert wait_for(lambda: c.put_n(lost, blocks(lost)) == [PutStatus.STORED] * len(lost),
                        timeout_s=20, step_s=0.5)
        assert c.get_n(lost, out) == [TierKind.SSD] * len(lost)
        assert np.array_equal(out, blocks(lost))
    assert d.proc.poll() is None


def test_a_full_disk_under_the_index_and_a_clean_stop(make_daemon, small_disk):
    d = make_daemon("--token-file", _tokens(small_disk), "--dram-size", "16KiB",
                    data_dir=str(small_disk / "data"), ssd_size="1MiB")
    with Client(d.url, "admin-secret", NS, use_shm=False) as c:
        warm = hash_blocks(NS, np.arange(40 * 16))
        c.put_n(warm, blocks(warm))  # the slab file grows to its extent now
        fill(small_disk, 0)  # and now not even RocksDB's log has a byte left
        hs = hash_blocks(NS, np.arange(16 * 16) + 10 ** 7)
        for i in range(0, 16, 4):
            st = c.put_n(hs[i:i + 4], blocks(hs[i:i + 4]))
            assert PutStatus.EXISTS not in st
        stored = [h for h in hs if c.contains_n([h])[0]]
        out = np.zeros((1, BB), np.uint8)
        for h in stored:  # whatever it says it holds, it holds intact
            assert c.get_n([h], out) != [None] and np.array_equal(out[0], block_of(h, BB))
    assert metric(d, "kvtier_internal_errors_total") == 0
    assert d.stop() == 0, d.output()  # memory tiers do not fit on the disk: logged, exit 0
    os.unlink(os.path.join(small_disk, "filler"))
    d.start()  # room again: everything acknowledged is there, and puts work
    with Client(d.url, "admin-secret", NS, use_shm=False) as c:
        out = np.zeros((len(stored), BB), np.uint8)
        assert None not in c.get_n(stored, out) and np.array_equal(out, blocks(stored))
        assert c.put_n(hs, blocks(hs)).count(PutStatus.NO_SPACE) == 0


def test_the_index_refuses_writes_on_a_full_disk_and_recovers_by_itself(small_disk):
    """RocksDB in its error state after ENOSPC: puts into slots the slab file already holds
    go on (the headers record them; their entries wait), and the tier reopens the index
    once there is room, with no restart (in-process, on the real tmpfs)."""
    import time

    import torch

    from kvstore.errors import TierIOError
    from kvstore.tiers import ssdindex
    from kvstore.tiers.ssd import SsdTier
    tier = SsdTier(NS, str(small_disk / "ssd"), 64)
    tier.recover()
    hs = hash_blocks(NS, np.arange(40 * 16))
    data = torch.from_numpy(blocks(hs))
    slots = tier.alloc_n(40)  # the slab file holds room for them already
    filler = fill(small_disk, 0)
    for i in range(0, 40, 4):
        tier.write_n(slots[i:i + 4], hs[i:i + 4], data[i:i + 4])
    with pytest.raises(TierIOError):  # the index's log has no room
        tier.index.flush()
    assert tier.index.num_queued == 40
    out = torch.zeros_like(data)
    assert tier.read_n(slots, hs, out) == [True] * 40 and torch.equal(out, data)
    os.unlink(filler)
    time.sleep(ssdindex.RETRY_S + 0.1)  # the index waits a moment before reopening
    tier.index.flush()
    assert tier.index.num_queued == 0 and all(bytes(h) in tier.raw_db() for h in hs)
    tier.close()
    tier = SsdTier(NS, str(small_disk / "ssd"), 64)
    assert sorted(h for h, _ in tier.recover()) == sorted(hs)
    assert tier.num_recovered_from_slabs == 0
    tier.close()


def _tokens(where) -> str:
    path = os.path.join(os.path.dirname(where), "tokens")
    with open(path, "w") as f:
        f.write("admin-secret\n")
    return path


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x55]))


def test_a_corrupted_sst_costs_nothing_and_fsck_reports_it(make_daemon, tmp_path):
    data = tmp_path / "data"
    d = make_daemon("--dram-size", "0", data_dir=str(data))
    hs = hash_blocks(NS, np.arange(300 * 16))
    with Client(d.url, namespace=NS, use_shm=False) as c:
        for i in range(0, 300, 50):
            c.put_n(hs[i:i + 50], blocks(hs[i:i + 50]))
    assert d.stop() == 0  # flushes RocksDB's memtable into an SST
    ssd = str(data / f"{NS.ns_id:016x}" / "ssd")
    (sst,) = glob.glob(os.path.join(ssd, "index", "*.sst"))
    _flip(sst, os.path.getsize(sst) // 3)
    fsck = [sys.executable, "-m", "kvtier", "fsck", ssd]
    report = subprocess.run(fsck, cwd=ROOT, capture_output=True, text=True)
    assert report.returncode == 1 and "damaged" in report.stdout, report.stdout + report.stderr
    d.start()  # recovery sets the index aside and rebuilds it from the slab file
    assert "rebuilding it from the slab file" in d.output()
    with Client(d.url, namespace=NS, use_shm=False) as c:
        out = np.zeros((300, BB), np.uint8)
        assert c.get_n(hs, out) == [TierKind.SSD] * 300
        assert np.array_equal(out, blocks(hs))
    assert d.stop() == 0
    clean = subprocess.run(fsck, cwd=ROOT, capture_output=True, text=True)
    assert clean.returncode == 0 and "300 blocks ok, 0 bad" in clean.stdout, clean.stdout


def test_corruption_met_while_serving_is_a_miss_for_that_block_only(make_daemon, tmp_path):
    data = tmp_path / "data"
    d = make_daemon("--dram-size", "0", data_dir=str(data))
    hs = hash_blocks(NS, np.arange(8 * 16))
    slab = str(data / f"{NS.ns_id:016x}" / "ssd" / "slabs.dat")
    with Client(d.url, namespace=NS, use_shm=False) as c:
        c.put_n(hs, blocks(hs))  # a fresh SSD-only tier: block i in slot i
        for slot in (2, 5):  # two payloads damaged on disk while the daemon runs
            _flip(slab, slot * stride_of(BB) + 100)
        out = np.zeros((8, BB), np.uint8)
        tiers = c.get_n(hs, out)  # one batch: the intact blocks come back, no error
        bad = [i for i, t in enumerate(tiers) if t is None]
        assert bad == [2, 5]
        for i, t in enumerate(tiers):
            if t is not None:
                assert np.array_equal(out[i], block_of(hs[i], BB))
        assert c.contains_n([hs[i] for i in bad]) == [False, False]  # removed
        assert c.remove_n(hs) == 6, "a reader count was left held"
        assert c.stats().tier(TierKind.SSD).counters.corrupt == 2


@pytest.mark.parametrize("use_shm", [False, True])
def test_corruption_met_after_a_streamed_reply_began_closes_it_and_the_retry_misses(
        make_daemon, tmp_path, use_shm):
    """A GET bigger than the daemon's 16 MiB scratch window reads its SSD blocks window by
    window as the reply goes out: a block found corrupted after the reply has promised it
    cannot be taken back, so the daemon closes the connection; the client retries, and the
    block, dropped, is a miss. No wrong byte reaches the caller, nothing stays held."""
    from kvstore.keys import Namespace
    ns = Namespace("test-model", num_layers=32, num_kv_heads=8, head_dim=64)  # 1 MiB blocks
    bb, n, bad = ns.block_bytes, 40, 37  # window: 16 copied, then 16 and 8 read as it goes
    data = tmp_path / "data"
    d = make_daemon("--dram-size", "0", data_dir=str(data), ssd_size="128MiB")
    hs = hash_blocks(ns, np.arange(n * 16) + 4242)
    slab = str(data / f"{ns.ns_id:016x}" / "ssd" / "slabs.dat")
    with Client(d.url, namespace=ns, use_shm=use_shm) as c:
        c.put_n(hs, np.stack([block_of(h, bb) for h in hs]))  # block i in slot i
        _flip(slab, bad * stride_of(bb) + 4096)
        out = np.zeros((n, bb), np.uint8)
        tiers = c.get_n(hs, out)
        assert [i for i, t in enumerate(tiers) if t is None] == [bad]
        assert all(np.array_equal(out[i], block_of(hs[i], bb)) for i in range(n) if i != bad)
        assert c.stats().tier(TierKind.SSD).counters.corrupt == 1
        assert c.remove_n(hs) == n - 1, "a reader count was left held"
    assert "found corrupted after its reply had promised it" in d.output()


@pytest.mark.parametrize("use_shm", [False, True])
def test_a_streamed_get_naming_a_block_twice_answers_both_and_holds_nothing(make_daemon,
                                                                            use_shm):
    """A GET may name a block twice, once in the window copied up front and once among the
    blocks read as the reply goes out: both copies come back exact, and no hold is left
    behind (a block once stayed held for good, and the reply was cut off)."""
    from kvstore.keys import Namespace
    ns = Namespace("test-model", num_layers=32, num_kv_heads=8, head_dim=64)  # 1 MiB blocks
    bb, n = ns.block_bytes, 36
    d = make_daemon("--dram-size", "0", ssd_size="128MiB")
    hs = hash_blocks(ns, np.arange(n * 16) + 5151)
    names = hs + [hs[0], hs[20]]
    with Client(d.url, namespace=ns, use_shm=use_shm) as c:
        c.put_n(hs, np.stack([block_of(h, bb) for h in hs]))
        out = np.zeros((len(names), bb), np.uint8)
        assert c.get_n(names, out) == [TierKind.SSD] * len(names)
        assert all(np.array_equal(out[i], block_of(h, bb)) for i, h in enumerate(names))
        assert c.remove_n(hs) == n, "a reader count was left held"


@pytest.mark.parametrize("dram", [0, 4])
def test_a_full_disk_whose_blocks_can_be_evicted_takes_every_put(small_disk, monkeypatch, dram):
    """The SSD tier may grow past what the disk holds: once the disk refuses to grow it, a
    put evicts its least recent blocks instead (straight, or under demotions from DRAM).
    It counted the growth it expected as room, evicted nothing, and answered NO_SPACE once
    per retry of the growth (every 50 ms here: a few times in this test)."""
    from kvstore.config import StoreConfig, TierConfig
    from kvstore.events import TierKind
    from kvstore.store import TieredStore
    from kvstore.tiers import ssd
    monkeypatch.setattr(ssd, "GROW_RETRY_S", 0.05)
    tiers = ((TierConfig(TierKind.DRAM, dram),) if dram else ()) + (
        TierConfig(TierKind.SSD, 8192, path=str(small_disk / "ssd")),)  # 32 MiB of slots
    with TieredStore(NS, StoreConfig(tiers)) as store:
        hs = hash_blocks(NS, np.arange(3000 * 16))  # 12 MiB on an 8 MiB disk
        statuses = [store.put_n([h], block_of(h, BB)[None])[0] for h in hs]
        assert statuses.count(PutStatus.STORED) == len(hs), statuses.count(PutStatus.NO_SPACE)
        out = np.zeros((1, BB), np.uint8)
        assert store.get_n(hs[-1:], out) != [None] and np.array_equal(out[0], block_of(hs[-1], BB))
        assert store.stats().tier(TierKind.SSD).used_blocks < 2048  # evicted: the disk is full


def test_a_batch_bigger_than_the_room_left_is_no_space_at_once(small_disk):
    """A disk with room for fewer slots than a batch needs: the put is answered (NO_SPACE
    for what found no slot), and the namespace keeps serving. The tier's growth came back
    empty ("at capacity") rather than failing, the tier asked again, and the put spun for
    ever under the store's lock."""
    import threading
    from kvstore.config import StoreConfig, TierConfig
    from kvstore.events import TierKind
    from kvstore.store import TieredStore
    from kvstore.tiers import slabfile
    tiers = (TierConfig(TierKind.SSD, 8192, path=str(small_disk / "ssd")),)
    with TieredStore(NS, StoreConfig(tiers)) as store:
        st = os.statvfs(small_disk)
        slot = stride_of(BB) + 64
        with open(small_disk / "filler", "wb") as f:  # the index's headroom and 3 slots left
            f.write(bytes(st.f_bavail * st.f_frsize - slabfile.INDEX_HEADROOM - 3 * slot - 1000))
        hs = hash_blocks(NS, np.arange(8 * 16) + 4242)
        done = []
        t = threading.Thread(target=lambda: done.append(store.put_n(
            hs, np.stack([block_of(h, BB) for h in hs]))), daemon=True)
        t.start()
        t.join(30)
        assert done, "the put never came back"
        assert PutStatus.NO_SPACE in done[0] and PutStatus.EXISTS not in done[0]
        stored = [h for h, s in zip(hs, done[0]) if s is PutStatus.STORED]
        out = np.zeros((len(stored), BB), np.uint8)
        assert store.get_n(stored, out) == [TierKind.SSD] * len(stored)


def test_restarts_on_a_full_disk_leave_the_index_its_room(small_disk):
    """RocksDB rolls its info log at every open and kept a thousand old ones (~50 KiB
    each): restarts on a full disk ate the index's headroom until it could not open."""
    from kvstore.tiers.ssd import SsdTier
    path = small_disk / "ssd"
    for _ in range(6):
        SsdTier(NS, str(path), 64).close()
    logs = [name for name in os.listdir(path / "index") if name.startswith("LOG")]
    assert len(logs) <= 2, logs


def test_a_restart_on_a_disk_filled_to_its_last_byte_serves_every_block(make_daemon,
                                                                        small_disk):
    """Stopped, then the disk filled by something else to its last byte: at the next start
    the namespace opens all the same (its namespace.json is not rewritten when unchanged;
    its index, which RocksDB cannot open without writing, waits for room while the slab
    headers say what the tier holds), its blocks are served intact, puts that need SSD are
    NO_SPACE, and once there is room the index is written and puts are stored. The start
    found no namespace it could open ("No space left on device") and served nothing."""
    d = make_daemon("--token-file", _tokens(small_disk), "--dram-size", "16KiB",
                    data_dir=str(small_disk / "data"), ssd_size="2MiB")
    hs = hash_blocks(NS, np.arange(200 * 16))
    with Client(d.url, "admin-secret", NS, use_shm=False) as c:
        assert c.put_n(hs, blocks(hs)).count(PutStatus.STORED) == 200
    assert d.stop() == 0, d.output()
    filler = fill(small_disk, 0)
    d.start()
    more = hash_blocks(NS, np.arange(64 * 16) + 10 ** 8)
    with Client(d.url, "admin-secret", NS, use_shm=False) as c:
        out = np.zeros((200, BB), np.uint8)
        assert c.get_n(hs, out) == [TierKind.SSD] * 200, d.output()[-3000:]
        assert np.array_equal(out, blocks(hs))
        assert PutStatus.EXISTS not in c.put_n(more, blocks(more))
        assert "cannot open for want of disk space" in d.output()
        os.unlink(filler)
        assert wait_for(lambda: c.put_n(more, blocks(more)).count(PutStatus.NO_SPACE) == 0,
                        timeout_s=20, step_s=0.5)
        assert c.get_n(hs[:8], out[:8]) == [TierKind.SSD] * 8
    assert metric(d, "kvtier_internal_errors_total") == 0
    assert d.stop() == 0
    (ssd,) = glob.glob(str(small_disk / "data" / "*" / "ssd"))  # its index agrees with it
    result = subprocess.run([sys.executable, "-m", "kvtier", "fsck", ssd], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ssd_tiers_sharing_a_disk_each_leave_their_index_room(small_disk):
    """Every SSD tier open on one filesystem keeps INDEX_HEADROOM free for its own index
    (which must write to reopen): one headroom for all of them let eight namespaces fill
    a disk to its last 12 KiB, and the next start opened none of them."""
    from kvstore.tiers.slabfile import INDEX_HEADROOM
    from kvstore.tiers.ssd import SsdTier
    tiers = [SsdTier(NS, str(small_disk / f"ssd{i}"), 4096) for i in range(3)]
    try:
        for t in tiers:
            t.recover()
        while any(t.alloc_n(1) is not None for t in tiers):  # each grows while it may
            pass
        assert os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize \
            >= 3 * INDEX_HEADROOM - (64 << 10)  # (RocksDB's own files took some of it)
    finally:
        for t in tiers:
            t.close()
    for i in range(3):  # and each reopens
        SsdTier(NS, str(small_disk / f"ssd{i}"), 4096).close()


def test_a_namespaces_files_are_the_daemons_uid_alone(make_daemon, tmp_path):
    """The SSD tier's index (every block's hash: which prompts this namespace has seen) and
    the metadata files were made 0644 under a directory any uid could list and read. The
    namespace's directory is 0700, also one an older version made open."""
    data = tmp_path / "data"
    d = make_daemon(data_dir=str(data))
    with Client(d.url, namespace=NS, use_shm=False) as c:
        hs = hash_blocks(NS, np.arange(4 * 16))
        assert c.put_n(hs, [block_of(h, NS.block_bytes) for h in hs]) == [PutStatus.STORED] * 4
    (ns_dir,) = [p for p in data.iterdir() if p.is_dir()]
    assert ns_dir.stat().st_mode & 0o777 == 0o700  # (what is in it: the umask's)
    d.stop()
    os.chmod(ns_dir, 0o755)  # as an older version left it
    d = make_daemon(data_dir=str(data))
    with Client(d.url, namespace=NS, use_shm=False) as c:
        assert c.contains_n(hs) == [True] * 4
    assert ns_dir.stat().st_mode & 0o777 == 0o700
