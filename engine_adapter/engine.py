"""LLMEngine: a synchronous continuous-batching loop over the paged model.

    engine = LLMEngine(model, EngineConfig(), tokenizer=tok, store=store)
    outs = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))

`step()` schedules, runs one forward pass, samples, retires finished requests and
returns their progress; `generate` steps until its requests finish.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np
import torch

from engine_adapter.block_pool import BlockPool
from engine_adapter.config import DEFAULT_REVISION, EngineConfig, OversizePolicy, kv_settings
from engine_adapter.connector import KVStoreLike, StoreConnector
from engine_adapter.errors import InvalidRequestError
from engine_adapter.fingerprint import weights_revision
from engine_adapter.model import LlamaForCausalLM
from engine_adapter.model_runner import ModelRunner
from engine_adapter.request import FinishReason, Request, RequestOutput
from engine_adapter.sampling import SamplingParams, sample
from engine_adapter.scheduler import Scheduler, cdiv
from kvstore.keys import BlockHash, Namespace, hash_blocks

Prompt = str | Sequence[int]


class LLMEngine:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig = EngineConfig(),
                 tokenizer: Any = None, store: KVStoreLike | None = None,
                 eos_token_id: int | None = None, record_logits: bool = False) -> None:
        mc = model.config
        weights = next(model.parameters(), None)
        if weights is not None and weights.dtype != getattr(torch, config.dtype):
            raise ValueError(f"the model's weights are {str(weights.dtype).removeprefix('torch.')} "
                              f"but EngineConfig.dtype is {config.dtype}: they must agree (load "
                              f"the model in {config.dtype}, or set dtype="
                              f"{str(weights.dtype).removeprefix('torch.')!r}); the first step "
                              "failed on it")
        self.model, self.config, self.tokenizer = model, config, tokenizer
        revision = mc.revision
        if revision == DEFAULT_REVISION:
            # no word of which weights these are (random ones, a config built by hand, a
            # transformers model named only): two models of one name shared their blocks,
            # and one was handed the other's KV. A fingerprint of the weights names them.
            revision = weights_revision(model.state_dict(), kv_settings(mc))
        self.ns = Namespace(mc.name, mc.num_layers, mc.num_kv_heads, mc.head_dim, config.dtype,
                            config.block_tokens, revision=revision, tenant=config.tenant,
                            codec=config.kv_codec)
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        self.max_model_len = config.model_len(mc)
        self.runner = ModelRunner(model, config)
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.connector = None if store is None else StoreConnector(
            store, self.runner.kv_cache, config.save_queue_batches, codec=config.kv_codec)
        self.scheduler = Scheduler(config, self.pool, self.connector)
        self.requests: dict[str, Request] = {}
        self.record_logits = record_logits
        self.logits: dict[str, list[torch.Tensor]] = {}  # per request, when record_logits
        self._ids = itertools.count()

    # ---------------------------------------------------------------- requests

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids")
            return list(self.tokenizer(prompt)["input_ids"])
        return _token_ids(prompt)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (`[{"role": "user", "content": ...}]`) with the model's template."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenize(text)

    def add_request(self, prompt: Prompt, params: SamplingParams | dict | None = None,
                    request_id: str | None = None, output_token_ids: Sequence[int] = (),
                    generator: torch.Generator | None = None) -> Request:
        """Queue a request (or resume one whose first outputs are known); raises
        InvalidRequestError for one that cannot be served, leaving the others untouched."""
        params = _as_params(params)
        ids = self.tokenize(prompt)
        self._validate(ids, params, len(output_token_ids))
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, list(output_token_ids), generator)
        req.block_hashes = hash_blocks(self.ns, req.token_ids[:req.num_tokens // self.config.block_tokens
                                                              * self.config.block_tokens])
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def _validate(self, ids: list[int], params: SamplingParams, num_outputs: int = 0) -> None:
        vocab = self.model.config.vocab_size
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; this model's context "
                                      f"is {self.max_model_len} (leave room for one output token)")
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"token ids must be in [0, {vocab})")
        self.check_fits_cache(len(ids), len(ids) + num_outputs, params)

    def check_fits_cache(self, num_prompt: int, num_tokens: int, params: SamplingParams) -> None:
        """Refuse what could never finish (InvalidRequestError): every token but the last
        sampled one needs K/V. Reads the config only: any thread may ask."""
        bt, num_blocks = self.config.block_tokens, self.config.num_blocks
        if cdiv(num_tokens, bt) > num_blocks:
            raise InvalidRequestError(f"the prompt needs {cdiv(num_tokens, bt)} KV blocks; the cache "
                                      f"has {num_blocks}: raise EngineConfig.num_blocks")
        if self.config.oversize_policy is OversizePolicy.TRUNCATE:
            return
        final = min(num_prompt + params.max_tokens, self.max_model_len)
        if cdiv(final - 1, bt) > num_blocks:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{cdiv(final - 1, bt)} KV blocks of {bt} tokens; the cache has {num_blocks}: "
                f"lower max_tokens to {num_blocks * bt + 1 - num_prompt} or less, raise "
                "EngineConfig.num_blocks, or set EngineConfig.oversize_policy='truncate' to "
                "end such requests with finish_reason 'length' when the cache is full")

    def save_cached(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Queue for saving to the store the blocks of `hashes` this engine's prefix cache
        still holds (ones the store lost: a request that hit them here saved nothing of
        them); whether each was queued."""
        if self.connector is None:
            return [False] * len(hashes)
        found = [self.pool.cached.get(BlockHash(bytes(h))) if self.pool.enable_caching else None
                 for h in hashes]
        held = [(h, b) for h, b in zip(hashes, found) if b is not None]
        if not held or not self.connector.save([BlockHash(bytes(h)) for h, _ in held],
                                               [b.block_id for _, b in held]):
            return [False] * len(hashes)  # (dropped: a full queue, a closed connector)
        return [b is not None for b in found]

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            req.finish_reason = FinishReason.ABORT
            self.scheduler.finish(req)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        exhausted = self.scheduler.take_exhausted()   # filled the cache (TRUNCATE): ended
        for r in exhausted:
            self.requests.pop(r.request_id, None)
        if not batch:
            assert exhausted or not self.scheduler.has_unfinished, "no request could be scheduled"
            return [RequestOutput.of(r) for r in exhausted]
        rows = [i for i, s in enumerate(batch)
                if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens]
        logits = self.runner.execute(batch, rows)
        for s in batch:
            s.request.num_computed_tokens += s.num_new_tokens
            s.request.num_model_tokens += s.num_new_tokens
            self._commit_full_blocks(s.request)
        reqs = [batch[i].request for i in rows]
        if self.record_logits:
            for r, row in zip(reqs, logits):
                self.logits.setdefault(r.request_id, []).append(row.clone())
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        for r, tok in zip(reqs, tokens):
            self._append_token(r, tok)
            if r.finished:
                self.requests.pop(r.request_id, None)
        return [RequestOutput.of(r) for r in exhausted] + [
            RequestOutput.of(s.request) for s in batch if s.request in reqs or s.request.finished]

    def _commit_full_blocks(self, req: Request) -> None:
        """Register newly computed full blocks in the prefix cache and save them to the store."""
        first, end = req.num_cached_blocks, req.num_computed_tokens // self.config.block_tokens
        if end <= first:
            return
        blocks, hashes = req.blocks[first:end], req.block_hashes[first:end]
        self.pool.cache_n(blocks, hashes)
        if self.connector is not None:
            self.connector.save(hashes, [b.block_id for b in blocks])
        req.num_cached_blocks = end

    def _append_token(self, req: Request, token: int) -> None:
        req.token_ids.append(token)
        bt = self.config.block_tokens
        if req.num_tokens % bt == 0:
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.extend(hash_blocks(self.ns, req.token_ids[-bt:], parent=parent))
        reason = self._finish_reason(req, token)
        if reason is not None:
            req.finish_reason = reason
            self.scheduler.finish(req)

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if (token == self.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if self.tokenizer is not None:
            delta = self._detokenize_step(req)
            if p.stop and delta:
                # a stop string found now ends in the new text: search only that tail
                start = max(0, len(req.text) - len(delta) - max(map(len, p.stop)) + 1)
                hits = [i for i in (req.text.find(s, start) for s in p.stop) if i >= 0]
                if hits:
                    req.text = req.text[:min(hits)]
                    return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _detokenize_step(self, req: Request) -> str:
        """Append the text of the newest output token(s) to req.text and return it.

        Decodes a short window (the tokens since the last emitted text, plus the previous
        emitted run as context) instead of the whole output: O(1) per token, not O(n). The
        window starts at a token boundary where text was emitted, so leading-space rules and
        multi-byte characters decode as in the full text; a trailing U+FFFD means a character
        is still incomplete, and it waits for the next token.
        """
        ids = req.token_ids
        window = self.tokenizer.decode(ids[req.detok_prefix_offset:], skip_special_tokens=True)
        before = self.tokenizer.decode(ids[req.detok_prefix_offset:req.detok_read_offset],
                                       skip_special_tokens=True)
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        delta = window[len(before):]
        req.detok_prefix_offset, req.detok_read_offset = req.detok_read_offset, len(ids)
        req.text += delta
        return delta

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching); outputs in prompt order."""
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while any(not r.finished for r in reqs):
            self.step()
        return [RequestOutput.of(r) for r in reqs]

    def close(self) -> None:
        """Flush pending store saves and stop the save thread (the store stays open)."""
        if self.connector is not None:
            self.connector.close()


def _as_params(params: SamplingParams | dict | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be SamplingParams or a dict, got {type(params).__name__}")
    return params


def _token_ids(prompt) -> list[int]:
    """A prompt of token ids as ints, each an integer (an int, a numpy or torch integer, or
    a float with no fraction): [1.7, 2.2] was taken for [1, 2], bytes and bools for ids, and
    a 2-D tensor or a NaN raised a bare ValueError."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise InvalidRequestError("a prompt is text or a sequence of token ids, not bytes")
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.detach().cpu()
    try:
        arr = np.asarray(prompt)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"a prompt's token ids must be integers ({e})") from None
    if arr.ndim != 1 and arr.size:
        raise InvalidRequestError(f"a prompt is one sequence of token ids, not shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iuf" or (arr.dtype.kind == "f" and not (
            np.all(np.isfinite(arr)) and np.all(arr == np.trunc(arr))))):
        raise InvalidRequestError(f"a prompt's token ids must be integers, got {arr.dtype} "
                                  f"values such as {arr.reshape(-1)[0]!r}")
    return [int(t) for t in arr.reshape(-1).tolist()]
