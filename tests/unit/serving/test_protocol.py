"""The router <-> worker messages: each decodes to what was encoded, frames come back in
order, and bytes that are not the message expected (another tag or version, a field of the
wrong type, bad sampling parameters, truncated, not msgpack) are a MessageError."""
import asyncio

import msgpack
import msgspec
import pytest

from engine_adapter.request import FinishReason
from engine_adapter.sampling import SamplingParams
from engine_adapter.serving.protocol import (GenerateRequest, MessageError, PrefillResult, Role,
                                             TokenEvent, WorkerInfo, frame, read_frame)
from kvstore.keys import Namespace
from kvstore.scheduler.cost_model import DecodeSample, PrefillSample, TransferSample

PARAMS = SamplingParams(temperature=0.5, top_k=3, seed=7, max_tokens=9, stop=("\n",))
MESSAGES = [
    WorkerInfo("prefill-0", Role.PREFILL, "m", 123, 512, 16, 2048,
               Namespace("m", 2, 2, 16, codec="int8", tenant="t"), 2,
               (PrefillSample(256, 0, 0.5),), (DecodeSample(1, 100, 0.01),),
               (TransferSample(1 << 20, 0.002),)),
    GenerateRequest("r1", (1, 2, 3), PARAMS),
    PrefillResult(b"handoff bytes", 5, "Hi", False, None, 16, 0, 17, (b"h" * 16,)),
    TokenEvent((5, 6), "Hi there", True, FinishReason.LENGTH, 16, 32, 2, (b"h" * 16,)),
    TokenEvent((), "", True, None, error="the prompt is empty"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_decodes_to_what_was_encoded(msg):
    back = type(msg).decode(msg.encode())
    assert back == msg
    if isinstance(msg, WorkerInfo):
        assert back.role is Role.PREFILL and back.ns.ns_id == msg.ns.ns_id
        assert type(back.prefill_samples[0]) is PrefillSample
    if isinstance(msg, GenerateRequest):
        assert type(back.params) is SamplingParams and back.params == PARAMS


def generate_fields(**params) -> list:
    """A GenerateRequest as the msgpack array it travels as, its params changed."""
    raw = msgspec.msgpack.decode(GenerateRequest("r1", (1, 2, 3), PARAMS).encode())
    raw[3].update(params)
    return raw


@pytest.mark.parametrize("raw, why", [
    (TokenEvent((), "", True, None).encode(), "Invalid value 'token-event/3'"),
    (msgspec.msgpack.encode(["generate/2", *generate_fields()[1:]]), "Invalid value 'generate/2'"),
    (msgpack.packb({"version": 2, "request_id": "r", "prompt_token_ids": [1], "params": {}}),
     "Expected `array`, got `object`"),                     # protocol 2's map
    (msgspec.msgpack.encode(["generate/3", "r1", ["1", "2"], {}]), "Expected `int`"),
    (msgspec.msgpack.encode(["generate/3", 7, [1], {}]), "Expected `str`"),
    (msgspec.msgpack.encode(generate_fields(temperature=-1.0)), "temperature must be >= 0"),
    (msgspec.msgpack.encode(generate_fields(max_tokens="9")), "Expected `int`"),
    (msgspec.msgpack.encode(generate_fields()[:3]), "of at least length"),
    (GenerateRequest("r1", (1, 2, 3), PARAMS).encode()[:-4], "truncated"),
    (b"\xc1 not msgpack", "invalid"),
    (b"", "truncated"),
])
def test_bytes_that_are_not_a_generate_request_are_a_message_error(raw, why):
    with pytest.raises(MessageError, match="malformed GenerateRequest") as e:
        GenerateRequest.decode(raw)
    assert why in str(e.value)


def test_a_block_hash_of_another_length_is_a_message_error():
    raw = msgspec.msgpack.decode(MESSAGES[2].encode())
    raw[-1] = [b"h" * 15]
    with pytest.raises(MessageError, match="length >= 16"):
        PrefillResult.decode(msgspec.msgpack.encode(raw))


def test_an_unknown_finish_reason_is_a_message_error():
    raw = msgspec.msgpack.decode(MESSAGES[3].encode())
    raw[4] = "tired"
    with pytest.raises(MessageError, match="Invalid enum value 'tired'"):
        TokenEvent.decode(msgspec.msgpack.encode(raw))


def read_all(data: bytes, cls) -> list:
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        out = []
        while (msg := await read_frame(reader, cls)) is not None:
            out.append(msg)
        return out
    return asyncio.run(run())


def test_frames_come_back_in_order_and_a_clean_end_is_none():
    events = [MESSAGES[3], MESSAGES[4], TokenEvent((9,), "x", False, None)]
    assert read_all(b"".join(frame(e) for e in events), TokenEvent) == events
    assert read_all(b"", TokenEvent) == []


def test_a_frame_cut_short_or_of_another_message_is_refused():
    whole = frame(MESSAGES[3])
    with pytest.raises(asyncio.IncompleteReadError):
        read_all(whole[:-3], TokenEvent)
    with pytest.raises(asyncio.IncompleteReadError):
        read_all(whole[:2], TokenEvent)
    with pytest.raises(MessageError, match="malformed TokenEvent"):
        read_all(frame(MESSAGES[1]), TokenEvent)
