"""Prefill / decode disaggregation over a shared KV store, and the colocated baseline.

    handoff = PrefillWorker(engine_a).prefill(prompt, params)   # computes, publishes blocks
    out = DecodeWorker(engine_b).decode([handoff])[0]           # loads blocks, keeps decoding

A `Handoff` is what crosses between the two (msgpack bytes, so processes can pass it on
any channel): the prompt, the first token, the sampling parameters and the sampler's
generator state, so seeded sampling continues exactly where the prefill left off. The
prompt's full blocks travel through the store; the decode worker recomputes only the
trailing partial block (and the first token's K/V).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import msgpack
import torch

from engine_adapter.engine import LLMEngine, Prompt
from engine_adapter.errors import InvalidRequestError
from engine_adapter.request import FinishReason, RequestOutput
from engine_adapter.sampling import SamplingParams

HANDOFF_VERSION = 1


@dataclass(frozen=True)
class Handoff:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    params: SamplingParams
    generator_state: bytes | None      # torch.Generator state after the first sample
    block_hashes: tuple[bytes, ...]    # the prompt's full blocks, as published
    finish_reason: FinishReason | None  # set when the first token already ended the request

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(self)
        d["params"] = dataclasses.asdict(self.params)
        d["finish_reason"] = None if self.finish_reason is None else self.finish_reason.value
        return msgpack.packb({"version": HANDOFF_VERSION, **d}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Handoff":
        d = msgpack.unpackb(raw, raw=False)
        if d.pop("version", None) != HANDOFF_VERSION:
            raise InvalidRequestError(f"handoff is not version {HANDOFF_VERSION}")
        d["params"] = SamplingParams.from_dict(d["params"])
        d["finish_reason"] = None if d["finish_reason"] is None else FinishReason(d["finish_reason"])
        d["prompt_token_ids"] = tuple(d["prompt_token_ids"])
        d["block_hashes"] = tuple(d["block_hashes"])
        return cls(**d)


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
        return [self._handoff(r, params) for r in reqs]

    def _handoff(self, req, params: SamplingParams) -> Handoff:
        reason = req.finish_reason
        if reason is FinishReason.LENGTH and params.max_tokens > 1:
            reason = None  # only our max_tokens=1 ended it: decoding continues
        gen = None if req.generator is None else bytes(req.generator.get_state().numpy().tobytes())
        num_full = req.num_prompt_tokens // self.engine.config.block_tokens
        return Handoff(req.request_id, tuple(req.token_ids[:req.num_prompt_tokens]),
                       req.output_token_ids[0], params, gen,
                       tuple(bytes(h) for h in req.block_hashes[:num_full]), reason)


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
                                                [h.first_token_id], _generator(h.generator_state)))
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


def _generator(state: bytes | None) -> torch.Generator | None:
    if state is None:
        return None
    gen = torch.Generator()
    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return gen
