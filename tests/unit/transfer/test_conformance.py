"""One conformance suite, run against every backend (see conftest.BACKENDS)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from transfer import DescList, Fault, Op, State, TransferError


def _prepare(p, length: int, count: int, stride: int | None = None):
    local = p.a.prepare(DescList.uniform(p.local_region, length, count, stride=stride))
    remote = p.a.prepare(DescList.uniform(p.remote_region.region_id, length, count,
                                          stride=stride), peer="b", backend=p.kind)
    assert remote.backend is p.kind
    return local, remote


def _expect(fault: Fault, fn) -> TransferError:
    """Run `fn` (post + wait); the failure may surface at post or at wait, never as DONE."""
    with pytest.raises(TransferError) as info:
        fn()
    assert info.value.fault is fault, info.value
    return info.value


@pytest.mark.parametrize("length,count", [(1, 1), (7, 33), (4096, 256), (65539, 17),
                                          (1 << 20, 3)])
def test_write_then_read_is_byte_exact(pair, length, count):
    p = pair
    local, remote = _prepare(p, length, count, stride=length + 5)
    perm = np.random.default_rng(length).permutation(count)
    p.a.post(Op.WRITE, local, np.arange(count), remote, perm).wait(5)
    got = p.seg.array
    for i, j in enumerate(perm[:50]):
        o, r = i * (length + 5), j * (length + 5)
        assert np.array_equal(got[r:r + length], p.src[o:o + length])
    dst = np.zeros(p.src.nbytes, np.uint8)
    back = p.a.prepare(DescList.uniform(p.a.register(dst), length, count, stride=length + 5))
    x = p.a.post(Op.READ, back, None, remote, perm)
    x.wait(5)
    assert x.poll() is State.DONE
    mask = np.zeros(dst.size, bool)
    for i in range(count):
        mask[i * (length + 5):i * (length + 5) + length] = True
    assert np.array_equal(dst[mask], p.src[mask])
    assert not dst[~mask].any()  # nothing outside the descriptors was touched


def test_many_transfers_in_flight(pair):
    p = pair
    local, remote = _prepare(p, 16384, 128)
    xs = [p.a.post(Op.WRITE, local, [i, i + 64], remote, [i + 64, i]) for i in range(64)]
    for x in xs:
        x.wait(5)
        x.release()
    got = p.seg.array[:128 * 16384].reshape(128, 16384)
    want = p.src[:128 * 16384].reshape(128, 16384)
    assert np.array_equal(got[64:], want[:64]) and np.array_equal(got[:64], want[64:])


def test_transfer_moves_the_bytes_before_it_returns(pair):
    """Agent.transfer is post, wait and release in one call, on every backend (tcp runs it
    on the calling thread when its connection is idle): also beside posted transfers still
    in flight on the same connection, and from several threads at once."""
    p = pair
    n, size = 128, 16384
    local, remote = _prepare(p, size, n)
    p.a.transfer(Op.WRITE, local, None, remote, None, 5)
    assert np.array_equal(p.seg.array[:n * size], p.src[:n * size])
    dst = np.zeros(n * size, np.uint8)
    back = p.a.prepare(DescList.uniform(p.a.register(dst), size, n))
    p.a.transfer(Op.READ, back, None, remote, None, 5)
    assert np.array_equal(dst, p.src[:n * size])
    dst[:] = 0
    errors = []

    def odd_ones(k: int) -> None:
        try:
            for i in range(2 * k + 1, n, 8):
                p.a.transfer(Op.READ, back, [i], remote, [i], 5)
        except Exception as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=odd_ones, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    posted = [p.a.post(Op.READ, back, [i], remote, [i]) for i in range(0, n, 2)]
    for t in threads:
        t.join(30)
    for x in posted:
        x.wait(5)
    assert not errors, errors
    assert np.array_equal(dst, p.src[:n * size])


def test_notifications_follow_the_data(pair):
    p = pair
    local, remote = _prepare(p, 4096, 8)
    p.a.post(Op.WRITE, local, None, remote, None, notify=b"written").wait(5)
    p.a.post(Op.READ, local, [0], remote, [1], notify=b"read").wait(5)
    p.a.send_notification("b", b"bare").wait(5)
    notes = p.b.notifications(timeout=2)
    while len(notes) < 3:
        more = p.b.notifications(timeout=2)
        assert more, notes
        notes += more
    assert [n.payload for n in notes] == [b"written", b"read", b"bare"]
    assert {n.peer for n in notes} == {"a"}
    assert p.a.notifications() == []


def test_out_of_range_descriptors_are_refused_at_prepare(pair):
    p = pair
    with pytest.raises(TransferError) as e:
        p.a.prepare(DescList.uniform(p.remote_region.region_id, 4096, 2,
                                     start=p.seg.size - 4096), peer="b", backend=p.kind)
    assert e.value.fault is Fault.OUT_OF_RANGE
    with pytest.raises(TransferError) as e:
        p.a.prepare(DescList.from_tuples([(p.local_region, -1, 10)]))
    assert e.value.fault is Fault.OUT_OF_RANGE


def test_bad_indices_and_length_mismatch(pair):
    p = pair
    local, remote = _prepare(p, 4096, 4)
    _expect(Fault.OUT_OF_RANGE, lambda: p.a.post(Op.WRITE, local, [4], remote, [0]))
    _expect(Fault.OUT_OF_RANGE, lambda: p.a.post(Op.WRITE, local, [0], remote, [-1]))
    _expect(Fault.OUT_OF_RANGE, lambda: p.a.transfer(Op.READ, local, [0], remote, [4], 5))
    _expect(Fault.INVALID, lambda: p.a.post(Op.WRITE, local, [0, 1], remote, [0]))
    other = p.a.prepare(DescList.uniform(p.remote_region.region_id, 100, 4), peer="b",
                        backend=p.kind)
    _expect(Fault.INVALID, lambda: p.a.post(Op.WRITE, local, [0], other, [0]))


def test_unregistered_and_unexported_memory(pair):
    p = pair
    stray = np.zeros(4096, np.uint8)
    with pytest.raises(TransferError) as e:
        p.a.prepare(DescList.from_tuples([(999, 0, 16)]))
    assert e.value.fault is Fault.UNREGISTERED
    private = p.b.register(stray, export=False)
    p.a.add_peer(p.b.metadata())
    with pytest.raises(TransferError) as e:
        p.a.prepare(DescList.from_tuples([(private.region_id, 0, 16)]), peer="b")
    assert e.value.fault is Fault.UNREGISTERED
    local, remote = _prepare(p, 4096, 4)
    p.a.deregister(p.local_region)
    _expect(Fault.UNREGISTERED, lambda: p.a.post(Op.WRITE, local, None, remote, None))
    _expect(Fault.UNREGISTERED, lambda: p.a.post(Op.WRITE, local, [1], remote, [2]))
    _expect(Fault.UNREGISTERED, lambda: p.a.transfer(Op.READ, local, [0], remote, [0], 5))


def test_remote_deregistered_after_prepare(pair):
    p = pair
    local, remote = _prepare(p, 4096, 4)
    p.b.deregister(p.remote_region)
    before = p.seg.array[:4 * 4096].copy()
    _expect(Fault.UNREGISTERED,
            lambda: p.a.post(Op.WRITE, local, None, remote, None).wait(5))
    assert np.array_equal(p.seg.array[:4 * 4096], before)


def test_unknown_peer(pair):
    p = pair
    with pytest.raises(TransferError) as e:
        p.a.prepare(DescList.from_tuples([(1, 0, 16)]), peer="nobody")
    assert e.value.fault is Fault.UNKNOWN_PEER


def test_peer_gone(pair):
    p = pair
    local, remote = _prepare(p, 4096, 4)
    p.a.post(Op.WRITE, local, None, remote, None).wait(5)
    p.b.close()
    err = _expect_any(lambda: p.a.post(Op.WRITE, local, None, remote, None).wait(5))
    assert err.fault in (Fault.PEER_GONE, Fault.CONNECTION_LOST), err


def _expect_any(fn) -> TransferError:
    with pytest.raises(TransferError) as info:
        fn()
    return info.value


def test_release_and_poll_contract(pair):
    p = pair
    local, remote = _prepare(p, 4096, 4)
    x = p.a.post(Op.WRITE, local, None, remote, None)
    x.wait(5)
    assert x.nbytes == 4 * 4096 and x.num_descs == 4
    x.release()
    with pytest.raises(TransferError):
        x.poll()


def test_closed_agent_refuses_work(pair):
    p = pair
    local, remote = _prepare(p, 4096, 1)
    p.a.close()
    _expect(Fault.CLOSED, lambda: p.a.post(Op.WRITE, local, None, remote, None))
