"""The Handoff record: its bytes give back the same handoff (sampling parameters, seed and
generator state exact), and bytes that are not a handoff raise InvalidRequestError."""
import dataclasses

import msgspec
import pytest
import torch

from engine_adapter.engine import LLMEngine
from engine_adapter.errors import InvalidRequestError
from engine_adapter.request import FinishReason
from engine_adapter.sampling import SamplingParams
from engine_adapter.workers import Handoff

PARAMS = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=2**63 + 5, max_tokens=7,
                        stop=("\n\n", "END"), stop_token_ids=(2, 3), ignore_eos=True)


def seeded_handoff(reason: FinishReason | None = None) -> tuple[Handoff, torch.Generator]:
    gen = PARAMS.make_generator()
    torch.rand(3, generator=gen)  # the prefill's draw moved the state past the seed
    state = gen.get_state().numpy().tobytes()
    return Handoff("req-1", (5, 6, 7, 8, 9), 42, PARAMS, state, (b"a" * 16, b"b" * 16), reason), gen


def fields(h: Handoff) -> list:
    """The handoff as the msgpack array it travels as, to be spoiled."""
    return msgspec.msgpack.decode(h.encode())


def test_a_handoff_round_trips_exactly_and_its_generator_continues_the_draws():
    h, gen = seeded_handoff()
    back = Handoff.decode(h.encode())
    assert back == h and type(back.params) is SamplingParams and back.params == PARAMS
    assert back.params.seed == 2**63 + 5 and back.generator_state == h.generator_state
    assert torch.equal(torch.rand(8, generator=back.generator()), torch.rand(8, generator=gen))


def test_a_finished_greedy_handoff_round_trips():
    h = Handoff("g", (1,), 2, SamplingParams(temperature=0), None, (), FinishReason.STOP)
    back = Handoff.decode(h.encode())
    assert back == h and back.finish_reason is FinishReason.STOP and back.generator() is None


def spoil(index: int, value):
    def apply(raw: list) -> list:
        raw[index] = value
        return raw
    return apply


def spoil_params(**kw):
    def apply(raw: list) -> list:
        raw[4].update(kw)
        return raw
    return apply


@pytest.mark.parametrize("spoiled, why", [
    (spoil(0, "handoff/1"), "Invalid value 'handoff/1'"),   # another version
    (spoil(2, ["5", "6"]), "Expected `int`"),                 # prompt ids that are not ints
    (spoil(3, None), "Expected `int`"),
    (spoil(6, [b"short"]), "length >= 16"),                   # a block hash of the wrong size
    (spoil(7, "tired"), "Invalid enum value 'tired'"),
    (spoil_params(temperature=-1.0), "temperature must be >= 0"),
    (spoil_params(seed="eleven"), "Expected `int | null`"),
    (lambda raw: raw[:5], "of at least length"),             # fields missing
    (lambda raw: raw + [1], "of at most length"),             # a field too many
])
def test_a_spoiled_handoff_is_an_invalid_request(spoiled, why):
    raw = msgspec.msgpack.encode(spoiled(fields(seeded_handoff()[0])))
    with pytest.raises(InvalidRequestError, match="malformed Handoff") as e:
        Handoff.decode(raw)
    assert why in str(e.value)


@pytest.mark.parametrize("raw", [b"", b"\xc1\xc1 not msgpack", b"\x93\x01\x02"])
def test_bytes_that_are_no_handoff_are_an_invalid_request(raw):
    with pytest.raises(InvalidRequestError, match="malformed Handoff"):
        Handoff.decode(raw)


def test_a_truncated_handoff_is_an_invalid_request():
    raw = seeded_handoff()[0].encode()
    with pytest.raises(InvalidRequestError, match="malformed Handoff"):
        Handoff.decode(raw[:-10])


def test_a_generator_state_torch_does_not_take_is_an_invalid_request():
    bad = Handoff("r", (1,), 2, PARAMS, b"\x00" * 10, (), None)
    with pytest.raises(InvalidRequestError, match="bad generator state"):
        Handoff.decode(bad.encode()).generator()


def test_the_handoff_of_a_prefilled_request(tiny_model, engine_config):
    engine = LLMEngine(tiny_model, engine_config)
    req = engine.add_request(list(range(10, 20)), dataclasses.replace(PARAMS, max_tokens=1))
    while not req.finished:
        engine.step()
    h = Handoff.of(req, PARAMS, engine_config.block_tokens)
    assert h.finish_reason is None  # only the prefill's max_tokens=1 ended it
    assert h.prompt_token_ids == tuple(range(10, 20)) and h.first_token_id == req.output_token_ids[0]
    assert h.block_hashes == tuple(bytes(x) for x in req.block_hashes[:2])  # 2 full blocks of 4
    assert h.generator().get_state().numpy().tobytes() == req.generator.get_state().numpy().tobytes()
