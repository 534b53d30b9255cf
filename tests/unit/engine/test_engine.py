"""The step loop: batching invariance, prefix-cache hits, preemption, stops, bad requests."""
import pytest

from engine_adapter.config import EngineConfig
from engine_adapter.engine import LLMEngine
from engine_adapter.errors import InvalidRequestError
from engine_adapter.request import FinishReason, Request
from engine_adapter.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def alone(model, config, prompts, params=GREEDY):
    return [LLMEngine(model, config).generate([p], params)[0].token_ids for p in prompts]


def test_batched_requests_match_running_each_alone(tiny_model, engine_config, prompts):
    expected = alone(tiny_model, engine_config, prompts)
    small_steps = EngineConfig(num_blocks=64, block_tokens=4, max_num_batched_tokens=10)
    engine = LLMEngine(tiny_model, small_steps)  # chunked prefills mixed with decodes
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert all(len(t) == 12 for t in expected)


def test_seeded_sampling_is_independent_of_the_batch(tiny_model, engine_config, prompts):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=5, max_tokens=10)
    expected = alone(tiny_model, engine_config, prompts, params)
    got = LLMEngine(tiny_model, engine_config).generate(prompts, params)
    assert [o.token_ids for o in got] == expected


def test_prefix_cache_hit_computes_only_the_suffix_with_identical_logits(tiny_model, engine_config, prompts):
    engine = LLMEngine(tiny_model, engine_config, record_logits=True)
    first = engine.generate([prompts[2]], GREEDY)[0]
    again = engine.generate([prompts[2]], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert again.num_local_hit_tokens == 36  # 40 tokens, 4-token blocks, keep one to compute
    assert again.num_model_tokens == first.num_model_tokens - 36
    a, b = (engine.logits[o.request_id] for o in (first, again))
    for x, y in zip(a, b):
        assert (x - y).abs().max() < 1e-4


def test_preemption_under_a_small_cache_keeps_outputs(tiny_model, engine_config, prompts):
    expected = alone(tiny_model, engine_config, prompts)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=20, block_tokens=4, max_num_batched_tokens=64))
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert engine.pool.num_free == 20 and not engine.has_unfinished


def test_stop_on_eos_stop_tokens_and_max_tokens(tiny_model, engine_config, prompts):
    tokens = alone(tiny_model, engine_config, prompts[:1])[0]
    eos = tokens[3]
    out = LLMEngine(tiny_model, engine_config, eos_token_id=eos).generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.token_ids == tokens[:tokens.index(eos) + 1] and out.finish_reason is FinishReason.STOP
    out = LLMEngine(tiny_model, engine_config).generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(tokens[5],)))[0]
    assert out.token_ids == tokens[:tokens.index(tokens[5]) + 1]
    out = LLMEngine(tiny_model, engine_config).generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.token_ids == tokens[:4] and out.finish_reason is FinishReason.LENGTH


class CharTokenizer:
    """Token t decodes to chr(ord('a') + t % 26): enough to test stop strings."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_end_and_truncate_the_text(tiny_model, engine_config, prompts):
    tokens = alone(tiny_model, engine_config, prompts[:1])[0]
    text = CharTokenizer().decode(tokens)
    stop = text[4:6]
    engine = LLMEngine(tiny_model, engine_config, tokenizer=CharTokenizer())
    out = engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == text[:text.index(stop)] and out.token_ids == tokens[:text.index(stop) + 2]


def test_text_shown_while_running_is_never_taken_back_by_a_stop_string(tiny_model, engine_config,
                                                                      prompts):
    """A stop string of several tokens: each step's text is a prefix of the next and of the
    final text (a stream of deltas adds up to the finished text). The text had shown the
    stop string's first part, cut once the string was whole, and a stream that had sent it
    could not take it back."""
    from engine_adapter.request import shown_text
    tokens = alone(tiny_model, engine_config, prompts[:1])[0]
    text = CharTokenizer().decode(tokens)
    stop = text[4:8]  # four tokens long
    engine = LLMEngine(tiny_model, engine_config, tokenizer=CharTokenizer())
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))
    seen = []
    while engine.has_unfinished:
        seen += [o.text for o in engine.step()]
    final = seen[-1]
    assert final == text[:text.index(stop)]
    assert all(final.startswith(t) for t in seen), seen
    assert shown_text("the answer", ("answer is",), False) == "the "
    assert shown_text("the answer", ("answer is", "r i"), False) == "the "
    assert shown_text("the ans", ("answer is",), True) == "the ans"
    assert shown_text("a\n\n", ("\n\n\n",), False) == "a"


def test_shown_text_holds_back_exactly_the_longest_tail_a_stop_string_begins_with():
    """Against the definition, by brute force, on random short texts and stops (the held
    back part is the longest proper prefix of a stop string the text ends with)."""
    import random

    from engine_adapter.request import shown_text
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice("ab ") for _ in range(rng.randrange(0, 12)))
        stops = tuple("".join(rng.choice("ab ") for _ in range(rng.randrange(1, 6)))
                      for _ in range(rng.randrange(1, 4)))
        held = max([k for s in stops for k in range(1, len(s))
                    if k <= len(text) and text.endswith(s[:k])], default=0)
        assert shown_text(text, stops, False) == text[:len(text) - held], (text, stops)
        assert shown_text(text, stops, True) == text


def test_a_stop_hold_fed_a_growing_text_holds_back_what_shown_text_defines():
    """StopHold reads each character once as the text grows (a step costs what it added):
    at every step of random texts grown by random pieces, some longer than every stop
    string, some a character, it holds back exactly the brute-force answer; a shorter text
    is read afresh, from its tail. Stops with repeats (borders) are the matcher's hard
    case."""
    import random

    from engine_adapter.request import StopHold, shown_text
    rng = random.Random(11)

    def brute(text, stops):
        return max([k for s in stops for k in range(1, len(s))
                    if k <= len(text) and text.endswith(s[:k])], default=0)

    for _ in range(400):
        stops = tuple("".join(rng.choice("aab") for _ in range(rng.randrange(1, 9)))
                      for _ in range(rng.randrange(1, 5)))
        hold, text = StopHold(stops), ""
        for _ in range(rng.randrange(1, 30)):
            if rng.random() < 0.1 and text:
                text = text[:rng.randrange(0, len(text))]  # shorter: read afresh
                assert hold.shown(text) == len(text) - brute(text, stops), (text, stops)
            text += "".join(rng.choice("ab") for _ in range(rng.choice((1, 1, 2, 5, 12))))
            assert hold.shown(text) == len(text) - brute(text, stops), (text, stops)
            assert shown_text(text, stops, False) == text[:len(text) - brute(text, stops)]


def test_a_request_s_text_is_held_back_by_its_own_stop_hold_step_by_step():
    """Request.shown_text keeps one StopHold for the request, fed the text as it grows, and
    shows all of the text once the request is finished."""
    from engine_adapter.request import Request, RequestStatus, StopHold
    req = Request("r", [1, 2, 3], SamplingParams(stop=("</s>", "ab" * 512)))
    for piece, shown in (("hello <", "hello "), ("/", "hello "), ("s", "hello "),
                         ("> a", "hello </s> "), ("b", "hello </s> "), ("c", "hello </s> abc")):
        req.text += piece
        assert req.shown_text == shown, (req.text, req.shown_text)
    assert isinstance(req._hold, StopHold) and req._hold.seen == len(req.text)
    req.status = RequestStatus.FINISHED
    assert req.shown_text == req.text


def test_holding_back_reads_each_new_character_once_per_stop_string(monkeypatch):
    """At the limits (16 stop strings of 1024 characters) and an output that keeps matching
    their starts, each step reads only what it added, once per stop string: trying each
    place in the tail, as before, had read ~1000 slices of the tail a step (~11 ms)."""
    from engine_adapter import request as rq
    from engine_adapter.sampling import MAX_STOP_CHARS, MAX_STOPS
    stops = tuple(("a" * k + "b" + "ab" * MAX_STOP_CHARS)[:MAX_STOP_CHARS] for k in range(MAX_STOPS))
    read = []
    advance = rq._advance
    monkeypatch.setattr(rq, "_advance", lambda stop, fail, q, new: read.append(len(new))
                        or advance(stop, fail, q, new))
    req = rq.Request("r", [1], SamplingParams(stop=stops))
    for step in range(3000):
        req.text += "a"
        assert req.shown_text == req.text[:step + 1 - min(step + 1, MAX_STOPS - 1)]
    assert sum(read) == 3000 * MAX_STOPS


def test_stop_strings_are_bounded_in_number_and_length():
    from engine_adapter.sampling import MAX_STOP_CHARS, MAX_STOPS
    SamplingParams(stop=("x" * MAX_STOP_CHARS,) * MAX_STOPS)
    for stop in (("x",) * (MAX_STOPS + 1), ("x" * (MAX_STOP_CHARS + 1),), ("",), (3,)):
        with pytest.raises(InvalidRequestError, match="stop"):
            SamplingParams(stop=stop)


@pytest.mark.parametrize("prompt,params,match", [
    ([], None, "empty"),
    (list(range(300)), None, "context"),
    ([1, 2, 99999], None, "token ids"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ([1, 2], {"best_of": 2}, "unknown sampling"),
    ("text", None, "tokenizer"),
])
def test_bad_requests_raise_and_the_engine_keeps_serving(tiny_model, engine_config, prompts, prompt, params, match):
    engine = LLMEngine(tiny_model, engine_config)
    good = engine.add_request(prompts[0], GREEDY)
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)
    while engine.has_unfinished:
        engine.step()
    assert good.output_token_ids == alone(tiny_model, engine_config, prompts[:1])[0]


class ByteTokenizer:
    """Token t is the byte t (UTF-8): characters span tokens, like byte-level BPE."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_text_equals_the_full_decode_and_waits_for_whole_characters(tiny_model, engine_config):
    engine = LLMEngine(tiny_model, engine_config, tokenizer=ByteTokenizer())
    text = "héllo → 日本語 ok 🙂!"
    out = list(text.encode())
    req = Request("r", [1, 2, 3], SamplingParams())
    for i, tok in enumerate(out):
        req.token_ids.append(tok)
        engine._detokenize_step(req)
        whole = ByteTokenizer().decode(out[:i + 1])
        assert "\ufffd" not in req.text and whole.startswith(req.text)
        assert len(whole.rstrip("\ufffd")) == len(req.text)
    assert req.text == text


def test_a_stop_string_spanning_tokens_and_characters_is_found(tiny_model, engine_config):
    engine = LLMEngine(tiny_model, engine_config, tokenizer=ByteTokenizer())
    req = Request("r", [1], SamplingParams(stop=("日本", "zz")))
    reasons = []
    for tok in "ab 日本 cd".encode():
        req.token_ids.append(tok)
        reasons.append(engine._finish_reason(req, tok))
        if reasons[-1] is not None:
            break
    assert reasons[-1] is FinishReason.STOP and req.text == "ab "
    assert len(reasons) == len("ab 日本".encode())
