"""One request's state in the engine, and what the engine reports back per step."""
from __future__ import annotations

import enum
from typing import NamedTuple

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
        """`text` as far as it can be shown now (streamed): see `shown_text`."""
        return shown_text(self.text, self.params.stop, self.finished)


def shown_text(text: str, stops, final: bool) -> str:
    """`text` less, until the request is `final`, any tail that may still grow into one of
    the `stops` strings (a stop string, once whole, is cut with all after it): a stream
    that had shown "answer" of the stop string "answer is" could not take it back, and its
    deltas added up to more than the finished text."""
    if final or not stops:
        return text
    keep = len(text)
    for s in stops:
        # a tail that begins a stop string starts with its first character: only those
        # places are tried, the farthest back (the longest tail) first
        at = text.find(s[0], max(0, len(text) - len(s) + 1))
        while 0 <= at < keep:
            if s.startswith(text[at:]):
                keep = at
                break
            at = text.find(s[0], at + 1)
    return text[:keep]


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
