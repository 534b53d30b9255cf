"""Reply frames the daemon encodes once and keeps: byte for byte what encoding them afresh
gives, and the cache stays bounded whatever keys clients cause."""
from __future__ import annotations

from kvstore import wire as w
from kvstore.daemon import session


def _decoded(frame: bytes) -> tuple[int, bool, w.Message, int]:
    code, reply, header_len, payload_len = w.decode_prefix(frame[:w.PREFIX.size], 1 << 40)
    msg = w.decode_header(code, reply, frame[w.PREFIX.size:w.PREFIX.size + header_len])
    assert len(frame) == w.PREFIX.size + header_len + w.header_pad(header_len, payload_len)
    return code, reply, msg, payload_len


def test_a_kept_frame_is_the_frame_encoded_afresh(monkeypatch):
    monkeypatch.setattr(session, "REPLY_FRAMES", {})
    first = session._reply_frame(w.Op.PUT, b"\x00\x01", 0, lambda: w.PutOk(statuses=b"\x00\x01"))
    again = session._reply_frame(w.Op.PUT, b"\x00\x01", 0, lambda: 1 / 0)  # not built again
    assert again is first and first == w.encode(w.PutOk(statuses=b"\x00\x01"), w.Op.PUT, True)
    code, reply, msg, payload = _decoded(first)
    assert (code, reply, msg.statuses, payload) == (int(w.Op.PUT), True, b"\x00\x01", 0)
    get = session._reply_frame(w.Op.GET, b"\x02", 4096, lambda: w.GetOk(tiers=b"\x02"))
    code, _, msg, payload = _decoded(get)
    assert (code, msg.tiers, msg.lease_id, payload) == (int(w.Op.GET), b"\x02", 0, 4096)
    # the same key with another payload length is another frame
    assert session._reply_frame(w.Op.GET, b"\x02", 8192, lambda: w.GetOk(tiers=b"\x02")) != get


def test_the_cache_keeps_only_short_keys_and_at_most_its_bound(monkeypatch):
    monkeypatch.setattr(session, "REPLY_FRAMES", {})
    monkeypatch.setattr(session, "MAX_REPLY_FRAMES", 8)
    long_key = bytes(17)
    frame = session._reply_frame(w.Op.PUT, long_key, 0, lambda: w.PutOk(statuses=long_key))
    assert _decoded(frame)[2].statuses == long_key and not session.REPLY_FRAMES
    for n in range(20):
        key = n.to_bytes(2, "little")
        assert _decoded(session._reply_frame(w.Op.PUT, key, 0,
                                             lambda: w.PutOk(statuses=key)))[2].statuses == key
    assert len(session.REPLY_FRAMES) == 8


def test_tier_bytes_gives_each_block_its_tier_code_and_misses_theirs():
    from kvstore.events import TierKind
    kinds = [TierKind.DRAM, None, TierKind.SSD, TierKind.GPU, None, TierKind.DRAM]
    assert session.tier_bytes(kinds) == bytes(w.MISS if t is None else int(t) for t in kinds)
    assert session.tier_bytes([TierKind.DRAM] * 16) == bytes([int(TierKind.DRAM)]) * 16
    assert session.tier_bytes([]) == b""
