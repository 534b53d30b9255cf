"""How many DRAM slots a put channel keeps granted: enough to ride out a drainer a busy
host leaves unscheduled, each channel its part of a quarter of the namespace's DRAM, and
never more than half of it over all grants (batches bigger than a stock, stocks kept from
before other channels opened)."""
import contextlib

import pytest

import numpy as np

from kvstore.daemon import putchannel
from kvstore.daemon.config import ADMIN, DaemonConfig
from kvstore.daemon.namespaces import Registry
from kvstore.daemon.putchannel import GRANT_BYTES, GRANT_CAPACITY, PutChannel
from kvstore.keys import Namespace

NS = Namespace("grants", num_layers=8, num_kv_heads=8, head_dim=64)  # 256 KiB blocks


@contextlib.contextmanager
def hosted_ns(tmp_path, dram_bytes: int):
    """NS hosted by a daemon's namespace registry with `dram_bytes` of DRAM and no SSD."""
    reg = Registry(DaemonConfig(data_dir=str(tmp_path), dram_bytes=dram_bytes, ssd_bytes=0))
    try:
        yield reg.open(NS, ADMIN)
    finally:
        reg.close()


def test_the_channels_of_a_namespace_share_a_quarter_of_its_dram(tmp_path):
    with hosted_ns(tmp_path, 192 << 20) as hosted:
        slots = hosted.dram.num_slots  # 768
        a = PutChannel(hosted)
        assert a.target() == min(GRANT_CAPACITY, GRANT_BYTES // NS.block_bytes, slots // 4) == 192
        assert len(a.granted) == 192  # stocked at once
        b = PutChannel(hosted)  # each channel's stock is its part of the quarter, and b's
        # comes at once, beyond the quarter a's earlier stock holds (a may stay idle: its
        # grants cannot be taken back, and b waited for them, its puts by request)
        assert a.target() == b.target() == slots // 8 and len(b.granted) == slots // 8
        a.drain()  # a keeps what it holds, and is granted no more until it is under its part
        assert len(a.granted) == 192
        c = PutChannel(hosted)  # a third: its part, as long as all grants stay within half
        assert c.target() == slots // 12 and len(c.granted) == slots // 12
        assert len(a.granted) + len(b.granted) + len(c.granted) <= slots // 2
        c.close()
        a.close()  # its slots go back
        b.drain()  # the next top-up
        assert b.target() == slots // 4 and len(b.granted) == slots // 4
        b.close()
        b.close()  # a second close counts nothing twice
        assert hosted.put_channels == 0


def test_a_tiny_arena_grants_nothing(tmp_path):
    with hosted_ns(tmp_path, 15 * NS.block_bytes) as hosted:
        ch = PutChannel(hosted)
        assert ch.target() == 0 and not ch.granted  # its clients put with a request
        ch.close()


def test_a_flush_for_a_big_batch_grants_it_up_to_half_the_dram(tmp_path):
    """A FLUSH naming a batch bigger than the channel's stock grants that batch's slots
    (the client writes them at once), as far as half the DRAM tier over all writers."""
    with hosted_ns(tmp_path, 64 * NS.block_bytes) as hosted:
        a = PutChannel(hosted)
        assert a.target() == 16 and len(a.granted) == 16
        a.drain(want=24)
        assert len(a.granted) == 24  # the batch, beyond the stock
        a.drain(want=40)
        assert len(a.granted) == 32  # never more than half the DRAM
        b = PutChannel(hosted)
        b.drain(want=20)
        assert not b.granted  # a's 32 are the half: b's batch goes by request
        a.close()
        b.drain(want=20)
        assert len(b.granted) == 20
        b.close()
        assert hosted.store.stats().tiers[0].free_blocks == 64  # every slot back


def test_a_channel_putting_big_batches_keeps_two_granted(tmp_path, monkeypatch):
    """After a FLUSH for a batch bigger than the stock, each commit of such a batch tops
    the grants up to two batches (within half the DRAM), so the next put finds slots
    without a FLUSH; once the client stops putting them, the stock is the usual one."""
    with hosted_ns(tmp_path, 128 * NS.block_bytes) as hosted:
        a = PutChannel(hosted)
        assert a.target() == 32 and len(a.granted) == 32
        a.drain(want=40)
        assert len(a.granted) == 40  # the FLUSH grants the batch
        for r in range(3):  # the client puts 40 at a time, the drainer commits each put
            slots = a.ring.take_grants(GRANT_CAPACITY)
            assert len(slots) >= 40
            a.ring.push([bytes([r, i]) * 8 for i in range(40)], slots[:40])
            assert a.drain() == 40
            assert len(a.granted) == 64  # two batches would be 80: half the DRAM is 64
            a.ring.push_grants(slots[40:])  # (given back to the ring: the client's stock)
        monkeypatch.setattr(putchannel, "BATCH_HOLD_S", 0.0)  # no such batch for a while
        slots = a.ring.take_grants(GRANT_CAPACITY)
        a.ring.push([bytes([9, i]) * 8 for i in range(8)], slots[:8])
        assert a.drain() == 8
        assert len(a.granted) == 64 - 8  # no top-up: more than the stock is granted still
        assert hosted.store.contains_n([bytes([9, i]) * 8 for i in range(8)]) == [True] * 8
        a.close()


def test_granting_evicts_no_more_than_the_share_lets_it_grant(tmp_path):
    """A grant capped by the share makes room for the slots it grants, not for all it was
    asked: a top-up asking for more than the cap evicted blocks just put."""
    with hosted_ns(tmp_path, 64 * NS.block_bytes) as hosted:
        store = hosted.store
        hs = [bytes([7, i]) * 8 for i in range(40)]
        store.put_n(hs, np.zeros((40, NS.block_bytes), np.uint8))
        assert len(store.grant_n(40, share=2)) == 32  # half of 64: 24 free, 8 evicted
        assert sum(store.contains_n(hs)) == 32


def test_a_stock_is_topped_up_once_it_has_gone_down_a_step_not_after_every_put(tmp_path):
    """Each top-up is a make-room pass of the store (~44 us of CPU for one slot, cold): the
    drainer grants again once an eighth of the stock is used, all of it at once; a FLUSH
    asking for slots is answered in full whatever the stock."""
    with hosted_ns(tmp_path, 192 << 20) as hosted:
        a = PutChannel(hosted)
        target, step = a.target(), a.target() // putchannel.TOP_UP_STEP  # 192, 24
        assert len(a.granted) == target
        slots = a.ring.take_grants(GRANT_CAPACITY)
        for i in range(step):  # single puts, each drained: the stock goes down, then back
            a.ring.push([bytes([5, i]) * 8], [slots[i]])
            assert a.drain() == 1
            assert len(a.granted) == (target - i - 1 if i + 1 < step else target)
        a.ring.push([bytes([6, 0]) * 8], [slots[step]])
        a.drain(want=target)  # a FLUSH naming a batch as big as the stock: granted in full
        assert len(a.granted) == target
        assert hosted.store.contains_n([bytes([5, i]) * 8 for i in range(step)]) == [True] * step
        a.close()


def test_committing_granted_slots_answers_each_record_and_frees_what_it_does_not_keep(
        tmp_path):
    """One commit of a batch of records (as a drain makes): a new block is STORED and
    published in its slot; a slot never granted is NO_SPACE and left alone; a block stored
    already, or named twice in the batch, is EXISTS and its slot goes back to the free
    list, published nowhere."""
    from kvstore.api import PutStatus
    from kvstore.keys import hash_blocks
    with hosted_ns(tmp_path, 64 * NS.block_bytes) as hosted:
        store, dram = hosted.store, hosted.dram
        hs = hash_blocks(NS, np.arange(4 * NS.block_tokens))
        old = store.grant_n(1)
        assert store.commit_granted(hs[:1], old) == [PutStatus.STORED]
        free_before = dram.num_free()
        slots = store.grant_n(3)
        ungranted = next(s for s in range(dram.num_slots) if s not in slots and s not in old)
        got = store.commit_granted([hs[1], hs[2], hs[0], hs[1]],
                                   [slots[0], ungranted, slots[1], slots[2]])
        assert got == [PutStatus.STORED, PutStatus.NO_SPACE, PutStatus.EXISTS, PutStatus.EXISTS]
        assert dram.num_free() == free_before - 1  # slots[1] and slots[2] came back
        assert store.contains_n([hs[0], hs[1], hs[2]]) == [True, True, False]
        gen = dram.directory._v.gen  # even: published; odd: free
        assert [gen[s] % 2 for s in slots] == [0, 1, 1]
        assert store.commit_granted(hs[3:4], slots[1:2]) == [PutStatus.NO_SPACE]  # given back


def test_a_ring_still_written_is_drained_again_later_unless_its_stock_would_run_out(
        tmp_path, monkeypatch):
    """A pass that finds records published meanwhile (the client still putting) leaves the
    ring marked awake, so its puts ring nothing, and tells the drainer to come back after
    REVISIT_S; at a pace that would use more than 1/REVISIT_SHARE of the stock by then, it
    rings the channel's doorbell instead (the drainer comes back at once). Every record is
    committed either way."""
    import os

    from kvstore.keys import hash_blocks
    from kvstore.putring import PutRing
    if putchannel.fence is None:
        return  # (without _stream every publish rings: no pass is left awake)
    with hosted_ns(tmp_path, 192 << 20) as hosted:
        ch = PutChannel(hosted)
        client = PutRing(ch.segment.array)  # the client's view of the same ring
        slots = client.take_grants(64)
        hs = hash_blocks(NS, np.arange(64 * NS.block_tokens))
        drain = ch.drain
        k = [0]

        def drain_while_the_client_puts(want=0):
            got = drain(want)
            client.push_one(hs[k[0]], slots[k[0]])  # published during the pass
            k[0] += 1
            return got
        monkeypatch.setattr(ch, "drain", drain_while_the_client_puts)
        client.push_one(hs[0], slots[0])
        k[0] = 1
        ch._pass_at = 0.0  # a slow pace: one record since long ago
        assert ch.drain_pass() is False
        assert not client.asleep()  # its next puts ring nothing
        with pytest.raises(BlockingIOError):
            os.eventfd_read(ch.doorbell)  # not rung
        import time
        ch._pass_at = time.monotonic()  # a record since a pass that began just now: a pace
        # that would use the stock up many times over by the revisit
        assert ch.drain_pass() is True
        assert os.eventfd_read(ch.doorbell) == 1  # rung: drained again at once
        monkeypatch.undo()
        ch.drain()
        assert hosted.store.contains_n(hs[:k[0]]) == [True] * k[0]
        ch.close()
