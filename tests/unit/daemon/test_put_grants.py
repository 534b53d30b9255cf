"""How many DRAM slots a put channel keeps granted: enough to ride out a drainer a busy
host leaves unscheduled, at most a quarter of the namespace's DRAM for all its channels."""
from kvstore.daemon.config import ADMIN, DaemonConfig
from kvstore.daemon.namespaces import Registry
from kvstore.daemon.putchannel import GRANT_BYTES, GRANT_CAPACITY, PutChannel
from kvstore.keys import Namespace

NS = Namespace("grants", num_layers=8, num_kv_heads=8, head_dim=64)  # 256 KiB blocks


def test_the_channels_of_a_namespace_share_a_quarter_of_its_dram(tmp_path):
    reg = Registry(DaemonConfig(data_dir=str(tmp_path), dram_bytes=192 << 20, ssd_bytes=0))
    try:
        hosted = reg.open(NS, ADMIN)
        slots = hosted.dram.num_slots  # 768
        a = PutChannel(hosted)
        assert a.target() == min(GRANT_CAPACITY, GRANT_BYTES // NS.block_bytes, slots // 4) == 192
        assert len(a.granted) == 192  # stocked at once
        b = PutChannel(hosted)  # the store grants no more than a quarter over all channels:
        assert a.target() == b.target() == slots // 8 and not b.granted  # b waits for a's
        a.close()  # its slots go back
        b.drain()  # the next top-up
        assert b.target() == slots // 4 and len(b.granted) == slots // 4
        b.close()
        b.close()  # a second close counts nothing twice
        assert hosted.put_channels == 0
    finally:
        reg.close()


def test_a_tiny_arena_grants_nothing(tmp_path):
    reg = Registry(DaemonConfig(data_dir=str(tmp_path), dram_bytes=15 * NS.block_bytes,
                                ssd_bytes=0))
    try:
        ch = PutChannel(reg.open(NS, ADMIN))
        assert ch.target() == 0 and not ch.granted  # its clients put with a request
        ch.close()
    finally:
        reg.close()


def test_a_flush_for_a_big_batch_grants_it_up_to_half_the_dram(tmp_path):
    """A FLUSH naming a batch bigger than the channel's stock grants that batch's slots
    (the client writes them at once), as far as half the DRAM tier over all writers."""
    reg = Registry(DaemonConfig(data_dir=str(tmp_path), dram_bytes=64 * NS.block_bytes,
                                ssd_bytes=0))
    try:
        hosted = reg.open(NS, ADMIN)
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
    finally:
        reg.close()
