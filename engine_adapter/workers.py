"""Prefill / decode disaggregation over a shared KV store, and the colocated baseline.

    handoff = PrefillWorker(engine_a).prefill(prompt, params)   # computes, publishes blocks
    out = DecodeWorker(engine_b).decode([handoff])[0]           # loads blocks, keeps decoding

A `Handoff` is what crosses between the two (a `transfer.codec.Record`, tag "handoff/2",
so processes can pass its bytes on any channel): the prompt, the first token, the sampling
parameters and the sampler's generator state, so seeded sampling continues exactly where
the prefill left off. Bytes that are not a handoff raise InvalidRequestError. The prompt's
full blocks travel through the store; the decode worker recomputes only the trailing
partial block (and the first token's K/V).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from engine_adapter.engine import LLMEngine, Prompt
from engine_adapter.errors import InvalidRequestError
from engine_adapter.request import FinishReason, Request, RequestOutput
from engine_adapter.sampling import SamplingParams
from kvstore.keys import HashField
from transfer.codec import Record


class Handoff(Record, tag="handoff/2"):
    ERROR = InvalidRequestError

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    params: SamplingParams
    generator_state: bytes | None      # torch.Generator state after the first sample
    block_hashes: tuple[HashField, ...]  # the prompt's full blocks, as published
    finish_reason: FinishReason | None  # set when the first token already ended the request

    @classmethod
    def of(cls, req: Request, params: SamplingParams, block_tokens: int) -> Handoff:
        """The handoff of `req`, prefilled with max_tokens=1 for a request under `params`."""
        reason = req.finish_reason
        if reason is FinishReason.LENGTH and params.max_tokens > 1:
            reason = None  # only our max_tokens=1 ended it: decoding continues
        gen = None if req.generator is None else bytes(req.generator.get_state().numpy().tobytes())
        num_full = req.num_prompt_tokens // block_tokens
        return cls(req.request_id, tuple(req.token_ids[:req.num_prompt_tokens]),
                   req.output_token_ids[0], params, gen,
                   tuple(bytes(h) for h in req.block_hashes[:num_full]), reason)

    def generator(self) -> torch.Generator | None:
        """The sampler's generator where the prefill left it (None for a greedy request);
        InvalidRequestError when the state is not one torch's CPU generator takes."""
        if self.generator_state is None:
            return None
        gen = torch.Generator()
        try:
            gen.set_state(torch.frombuffer(bytearray(self.generator_state), dtype=torch.uint8))
        except (RuntimeError, ValueError) as e:
            raise InvalidRequestError(f"handoff {self.request_id!r}: bad generator state "
                                      f"({len(self.generator_state)} bytes): {e}") from e
        return gen


class Worker:
    """Colocated prefill + decode on one engine: the baseline."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        return self.engine.generate(prompts, params)


class PrefillWorker:
    """Computes prompts (only their uncached suffix), samples the first token, publishes the
    prompt's blocks to the store and returns a handoff per prompt."""

    def __init__(self, engine: LLMEngine) -> None:
        if engine.connector is None:
            raise ValueError("a PrefillWorker's engine needs a store to publish blocks to")
        self.engine = engine

    def prefill(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[Handoff]:
        params = params if params is not None else SamplingParams()
        reqs = [self.engine.add_request(p, dataclasses.replace(params, max_tokens=1)) for p in prompts]
        while any(not r.finished for r in reqs):
            self.engine.step()
        self.engine.connector.flush()  # published before anyone is told to fetch
        return [Handoff.of(r, params, self.engine.config.block_tokens) for r in reqs]


class DecodeWorker:
    """Continues handed-off requests: loads their prefix from the store, decodes to the end."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def decode(self, handoffs: Sequence[Handoff]) -> list[RequestOutput]:
        reqs, done = [], {}
        for h in handoffs:
            if h.finish_reason is not None:
                done[h.request_id] = RequestOutput(h.request_id, [h.first_token_id], "", True,
                                                   h.finish_reason, 0, 0, 0)
                continue
            reqs.append(self.engine.add_request(list(h.prompt_token_ids), h.params, h.request_id,
                                                [h.first_token_id], h.generator()))
            self._check_namespace(h, reqs[-1].block_hashes)
        while any(not r.finished for r in reqs):
            self.engine.step()
        done.update((r.request_id, RequestOutput.of(r)) for r in reqs)
        return [done[h.request_id] for h in handoffs]

    def _check_namespace(self, h: Handoff, ours) -> None:
        if tuple(bytes(x) for x in ours[:len(h.block_hashes)]) != h.block_hashes:
            self.engine.abort(h.request_id)
            raise InvalidRequestError(f"handoff {h.request_id!r} was prefilled in another namespace "
                                      "(model, dtype, block size or tenant differ)")
