"""The cache-bypassing host copy (transfer/_stream.c) against numpy's: every byte where it
belongs whatever the alignment and length, nothing written outside the destination, and
bad arguments refused; copy_bytes routes a put's copies into slots (`cold`) through it
from STREAM_COLD_BYTES up, and every other copy through numpy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer import copy as tc

stream = pytest.importorskip("transfer._stream", reason="transfer._stream is missing: "
                             "reinstall kvtier with a C compiler (pip install -e .)")


def test_every_length_and_alignment_lands_exactly_where_it_should():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    for dst_off in (0, 1, 15, 16, 63, 64, 65):
        for src_off in (0, 3, 64):
            for n in (0, 1, 63, 64, 65, 127, 128, 129, 4095, 4096 + 17):
                dst = np.zeros(n + 256, np.uint8)
                stream.copy(dst[dst_off:dst_off + n], src[src_off:src_off + n])
                assert (dst[dst_off:dst_off + n] == src[src_off:src_off + n]).all()
                assert not dst[:dst_off].any() and not dst[dst_off + n:].any()


def test_copy_at_lands_exactly_where_copy_does():
    """By address (a same-host put of one tensor's block): every alignment and length,
    nothing written outside the destination; no address, or a negative size, refused."""
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, (1 << 19) + 64, dtype=np.uint8)
    for dst_off, src_off, n in ((0, 0, 0), (1, 3, 129), (63, 0, 4096 + 17),
                                (16, 64, tc.STREAM_COLD_BYTES), (5, 7, 1 << 19)):
        for cold in (False, True):
            dst = np.zeros(n + 256, np.uint8)
            tc.copy_at(dst.ctypes.data + dst_off, src.ctypes.data + src_off, n, cold)
            assert (dst[dst_off:dst_off + n] == src[src_off:src_off + n]).all()
            assert not dst[:dst_off].any() and not dst[dst_off + n:].any()
    dst = np.zeros(8, np.uint8)
    with pytest.raises(ValueError):
        stream.copy_at(0, src.ctypes.data, 8)
    with pytest.raises(ValueError):
        stream.copy_at(dst.ctypes.data, src.ctypes.data, -1)
    assert not dst.any()


def test_bad_buffers_are_refused_and_nothing_is_written():
    dst = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="100"):
        stream.copy(dst, bytes(99))
    assert not dst.any()
    with pytest.raises(TypeError):  # a read-only destination
        stream.copy(b"x" * 100, dst)
    with pytest.raises((BufferError, TypeError)):  # not contiguous
        stream.copy(np.zeros(200, np.uint8)[::2], bytes(100))


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("nbytes", [tc.STREAM_COLD_BYTES - 1, tc.STREAM_COLD_BYTES, 4 << 20])
def test_copy_bytes_moves_host_blocks_exactly_either_way(nbytes, cold):
    """Streamed or not, torch and numpy rows, strided views (which cannot stream) and
    read-only destinations keep their behaviour."""
    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    for dst in (np.zeros(nbytes, np.uint8), torch.zeros(nbytes, dtype=torch.uint8)):
        tc.copy_bytes(dst, src, cold)
        assert (np.asarray(dst) == src).all()
    rows = torch.from_numpy(src.copy()).view(1, nbytes)
    out = np.zeros((1, nbytes), np.uint8)
    tc.copy_bytes(out, rows, cold)
    assert (out[0] == src).all()
    strided = np.zeros(2 * nbytes, np.uint8)[::2]
    tc.copy_bytes(strided, src, cold)
    assert (strided == src).all()
    frozen = np.zeros(nbytes, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        tc.copy_bytes(frozen, src, cold)
    with pytest.raises(TypeError):  # another dtype is not cast, streamed or not
        tc.copy_bytes(np.zeros(nbytes // 2, np.float16), np.zeros(nbytes // 2, np.uint16), cold)


class _Counted:
    def __init__(self) -> None:
        self.calls = 0

    def copy(self, dst, src) -> None:
        self.calls += 1
        stream.copy(dst, src)


def test_only_big_copies_into_slots_stream(monkeypatch):
    """A put's copy into the slot it fills streams from STREAM_COLD_BYTES; a get's copy
    (not `cold`: its reader is about to look) never does."""
    assert tc.STREAMING and tc._stream is stream
    counted = _Counted()
    monkeypatch.setattr(tc, "_stream", counted)
    for nbytes, cold, streams in ((tc.STREAM_COLD_BYTES, True, True),
                                  (tc.STREAM_COLD_BYTES - 1, True, False),
                                  (4 << 20, False, False)):
        before = counted.calls
        dst = np.zeros(nbytes, np.uint8)
        tc.copy_bytes(dst, np.ones(nbytes, np.uint8), cold)
        assert dst.all() and (counted.calls > before) == streams, (nbytes, cold)


def test_a_dram_tier_put_streams_and_its_get_does_not(monkeypatch):
    from kvstore.tiers.dram import DramTier
    counted = _Counted()
    monkeypatch.setattr(tc, "_stream", counted)
    bb = tc.STREAM_COLD_BYTES
    tier = DramTier(4, bb)
    try:
        src = np.random.default_rng(1).integers(0, 256, (2, bb), dtype=np.uint8)
        tier.write_n([2, 3], [bytes(16), bytes([1]) * 16], torch.from_numpy(src))
        assert counted.calls == 1  # one run of two slots, one copy
        out = np.zeros((2, bb), np.uint8)
        assert tier.read_n([2, 3], [bytes(16), bytes([1]) * 16], out) == [True, True]
        assert counted.calls == 1 and (out == src).all()
    finally:
        tier.close()


def _shrunk_mapping(tmp_path, size: int = 1 << 20):
    """A shared mapping of a file, the file then truncated to one page under it."""
    import mmap
    import os
    path = tmp_path / "region"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    view = np.frombuffer(mm, np.uint8)
    view[:] = 7
    os.ftruncate(fd, 4096)
    os.close(fd)
    return mm, view


def test_a_guarded_copy_past_a_shrunk_file_fails_and_the_process_lives_on(tmp_path):
    """A peer's region file truncated under this process's mapping: a guarded copy of it,
    either way, returns False (a plain one's SIGBUS killed the process); from another
    thread too; a copy of the pages still there works, and copy_runs says which run."""
    import threading
    _, view = _shrunk_mapping(tmp_path)
    out = np.zeros(view.size, np.uint8)
    assert tc.guarded_copy(out, view) is False
    assert tc.guarded_copy(view, out) is False
    got = []
    t = threading.Thread(target=lambda: got.append(tc.guarded_copy(out, view)))
    t.start()
    t.join()
    assert got == [False]
    view[:4096] = 9  # (the failed copies above left it, and out, in part written)
    assert tc.guarded_copy(out[:4096], view[:4096]) is True and (out[:4096] == 9).all()
    with pytest.raises(tc.Unreachable) as e:
        tc.copy_runs([out, out], np.array([0, 8192]), [view, view], np.array([0, 8192]),
                     np.array([4096, 4096]), guard=True)
    assert e.value.run == 1
    with pytest.raises(ValueError, match="copy of 4096 bytes into a buffer of 8"):
        tc.guarded_copy(out[:8], view[:4096])


FAULT_OUTSIDE = """
import faulthandler, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests.unit.transfer.test_stream_copy import _shrunk_mapping
from transfer.copy import guarded_copy
import pathlib
if {faulthandler} == "before":
    faulthandler.enable()
mm, view = _shrunk_mapping(pathlib.Path({tmp!r}))
out = np.zeros(view.size, np.uint8)
assert guarded_copy(out, view) is False  # (the guard in place)
if {faulthandler} == "after":  # (installed over the guard's handler, had it stayed)
    faulthandler.enable()
    assert guarded_copy(out, view) is False
print("guarded", flush=True)
out[:] = view  # not guarded: dies of SIGBUS as ever
print("survived", flush=True)
"""


@pytest.mark.parametrize("faulthandler", ["none", "before", "after"])
def test_a_fault_outside_a_guarded_copy_still_kills_as_before(tmp_path, faulthandler):
    """The guard's SIGBUS handler takes only faults inside a guarded copy: any other goes
    to the handler before it (faulthandler's traceback) or kills the process as the
    default does. faulthandler enabled after a guarded copy: one traceback, then death
    (the guard's handler, left installed, and faulthandler's chained to each other, and
    such a fault went round the two for ever)."""
    import os
    import signal
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    code = FAULT_OUTSIDE.format(root=root, tmp=str(tmp_path), faulthandler=repr(faulthandler))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "guarded" in r.stdout and "survived" not in r.stdout, (r.stdout, r.stderr)
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stderr)
    assert r.stderr.count("Fatal Python error: Bus error") == (faulthandler != "none"), r.stderr


def test_guarded_runs_land_exactly_and_a_run_outside_its_buffers_is_refused_first():
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    runs = [(0, 100, 7), (9000, 0, 4096), (60000, 20000, 5536)]  # (dst at, src at, n)
    dos, sos, ns = (list(x) for x in zip(*runs))
    assert stream.guarded_copy_runs([dst] * 3, dos, [src] * 3, sos, ns) == -1
    want = np.zeros_like(dst)
    for d, s, n in runs:
        want[d:d + n] = src[s:s + n]
    assert np.array_equal(dst, want)
    before = dst.copy()
    for bad in ([(0, 0, 8), (1 << 16, 0, 1)], [(0, 0, 8), (0, -1, 1)], [(0, 0, 8), (10, 0, 1 << 16)]):
        dos, sos, ns = (list(x) for x in zip(*bad))
        with pytest.raises(ValueError, match="run 1 .* is outside its buffers"):
            stream.guarded_copy_runs([dst] * 2, dos, [src] * 2, sos, ns)
        assert np.array_equal(dst, before)  # (run 0 not copied either)
    with pytest.raises(ValueError, match="different lengths"):
        stream.guarded_copy_runs([dst], [0, 1], [src], [0], [1])
    with pytest.raises(BufferError):  # a read-only destination
        stream.guarded_copy_runs([src.tobytes()], [0], [src], [0], [1])
