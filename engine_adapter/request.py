"""One request's state in the engine, and what the engine reports back per step."""
from __future__ import annotations

import enum
import functools
from typing import NamedTuple, Sequence

import torch

from engine_adapter.block_pool import KVCacheBlock
from engine_adapter.sampling import SamplingParams
from kvstore.keys import BlockHash


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"          # EOS, a stop token or a stop string
    LENGTH = "length"      # max_tokens, the context limit, or a full KV cache (TRUNCATE)
    ABORT = "abort"


class Request:
    """Tokens so far (`token_ids` = prompt + outputs), how many have K/V in the cache, its
    blocks and their hashes. Prefill and decode are the same thing: compute the tokens
    past `num_computed_tokens`, then sample after the last one."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 output_token_ids: list[int] | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids) + list(output_token_ids or [])
        self.generator = generator if generator is not None else (
            None if params.greedy else params.make_generator())
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.blocks: list[KVCacheBlock] = []
        self.block_hashes: list[BlockHash] = []
        self.num_computed_tokens = 0     # tokens whose K/V is in this request's blocks
        self.num_cached_blocks = 0       # leading blocks registered in the prefix cache
        self.num_local_hit_tokens = 0    # prefix found in the engine's own paged cache
        self.num_loaded_tokens = 0       # prefix loaded from the store
        self.num_model_tokens = 0        # tokens the model actually ran a forward pass over
        self.num_skips = 0               # later requests admitted ahead of it while it waited
        self.text = ""
        self._hold: StopHold | None = None  # what of `text` a stop string may still claim
        # incremental detokenization: text is emitted for tokens before read_offset; decoding
        # restarts at prefix_offset (the previous emitted run) for context
        self.detok_prefix_offset = self.detok_read_offset = self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def shown_text(self) -> str:
        """`text` as far as it can be shown now (streamed): see `shown_text`. Each step
        looks at the text added since the last (`StopHold`), not at a tail as long as the
        stop strings."""
        if self.finished or not self.params.stop:
            return self.text
        if self._hold is None:
            self._hold = StopHold(self.params.stop)
        return self.text[:self._hold.shown(self.text)]


def shown_text(text: str, stops, final: bool) -> str:
    """`text` less, until the request is `final`, any tail that may still grow into one of
    the `stops` strings (a stop string, once whole, is cut with all after it): a stream
    that had shown "answer" of the stop string "answer is" could not take it back, and its
    deltas added up to more than the finished text."""
    if final or not stops:
        return text
    return text[:StopHold(stops).shown(text)]


@functools.lru_cache(maxsize=256)
def _borders(stop: str) -> tuple[int, ...]:
    """KMP's failure function of `stop`: [k] is the length of the longest proper prefix
    of stop[:k + 1] that is also its suffix."""
    fail, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class StopHold:
    """How much of a growing text can be shown: all but its longest tail that is a proper
    prefix of one of `stops`. Each stop string's matcher (Knuth-Morris-Pratt) reads every
    character once, as the text grows: a step costs what it added. Trying each place in the
    tail where a stop string's first character stood, as shown_text had (a slice and a
    compare each), cost up to ~11 ms a step at the limits (16 stop strings of 1024
    characters, an output that keeps matching their starts), in the engine's step loop,
    which every other request waited for."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.fails = [_borders(s) for s in self.stops]
        self.states = [0] * len(self.stops)  # the longest proper prefix of each that ends it
        self.longest = max(map(len, self.stops), default=1)
        self.seen = 0  # characters of the text read so far

    def shown(self, text: str) -> int:
        """How many leading characters of `text` (the text read before, and more) to show.
        A text shorter than the last one is read afresh, from its tail (the caller's to
        say it is not the same text grown: `Request.text` only grows while it runs)."""
        # a tail that may still become a stop string is shorter than it: nothing before
        # the last `longest - 1` characters needs reading
        tail = len(text) - self.longest + 1
        if len(text) < self.seen or tail > self.seen:  # (what was read ends no tail now)
            self.states = [0] * len(self.stops)
            self.seen = max(0, tail)
        new = text[self.seen:]
        self.seen = len(text)
        if new:
            for k, (stop, fail) in enumerate(zip(self.stops, self.fails)):
                self.states[k] = _advance(stop, fail, self.states[k], new)
        return len(text) - max(self.states, default=0)


def _advance(stop: str, fail: tuple[int, ...], q: int, new: str) -> int:
    """The matcher of `stop` in state q (that many of its first characters end the text)
    after reading `new`; a whole match falls back to its longest border (a stop string
    that is whole is the engine's to cut, not a tail to hold)."""
    last = len(stop)
    for ch in new:
        while q and stop[q] != ch:
            q = fail[q - 1]
        if stop[q] == ch:
            q += 1
            if q == last:
                q = fail[q - 1]
    return q


class RequestOutput(NamedTuple):
    request_id: str
    token_ids: list[int]           # generated so far
    text: str                      # detokenized output (empty without a tokenizer)
    finished: bool
    finish_reason: FinishReason | None
    num_local_hit_tokens: int      # prompt tokens found in the engine's paged cache
    num_loaded_tokens: int         # prompt tokens loaded from the store
    num_model_tokens: int          # tokens the model computed for this request

    @classmethod
    def of(cls, r: Request) -> "RequestOutput":
        return cls(r.request_id, r.output_token_ids, r.shown_text, r.finished, r.finish_reason,
                   r.num_local_hit_tokens, r.num_loaded_tokens, r.num_model_tokens)
