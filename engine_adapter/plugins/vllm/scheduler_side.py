"""Scheduler-side bookkeeping of the kvtier vLLM connector (no vLLM imports: plain state).

Per request it keeps the kvtier hashes of the prompt's full blocks, the vLLM block ids the
request holds, how many leading blocks are known to be stored, and a pending load. Each step
it turns that into `KVTierMetadata`: blocks to load before the forward pass, and prompt
blocks that this step's forward pass completes, to save after it. With `save_decode`, blocks
that decoding fills are saved too: their hashes extend the prompt's chain from the
request's live token list (vLLM's `Request.all_token_ids`, which already holds every token
the step feeds to the model).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from engine_adapter.plugins.base import STORE_OUTAGES
from kvstore.api import BlockStore
from engine_adapter.plugins.vllm.metadata import BlockTransfer, KVTierMetadata
from kvstore.keys import Namespace, hash_blocks

log = logging.getLogger("kvtier.vllm")


@dataclass
class _Request:
    hashes: list[bytes]            # full blocks hashed so far (the prompt's, then decode's)
    num_stored: int                # leading blocks known to be in kvtier (matched or saved)
    tokens: Sequence[int] = ()     # the request's live token list (prompt + outputs so far)
    num_local_tokens: int = 0      # vLLM's own prefix-cache hit at lookup
    block_ids: list[int] = field(default_factory=list)
    load: tuple[int, int] | None = None   # [first, end) blocks to load, until handed over
    is_async: bool = False
    extra: bytes = b""             # mixed into every block hash (see SchedulerSide.lookup)
    marks: dict[int, bytes] = field(default_factory=dict)  # block -> mixed into it alone


class SchedulerSide:
    def __init__(self, ns: Namespace, store: BlockStore, async_load: bool = False,
                 save_decode: bool = False) -> None:
        self.ns, self.store, self.async_load, self.save_decode = ns, store, async_load, save_decode
        self.requests: dict[str, _Request] = {}
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0

    def lookup(self, req_id: str, prompt: Sequence[int], num_computed_tokens: int,
               tokens: Sequence[int] = (), extra: bytes | None = b"",
               marks: dict[int, bytes] | None = None) -> tuple[int, bool]:
        """`get_num_new_matched_tokens`: tokens past vLLM's own hit that kvtier can load.
        `tokens`: the request's live token list, read later for decode saves. `extra`: what
        besides the token ids the request's KV depends on throughout (its LoRA adapter,
        cache salt), mixed into every block hash; None: KV its token ids do not name
        (prompt embeddings), neither loaded nor saved. `marks`: what the KV depends on from
        a block on (an image's content, from the block its placeholder starts in), mixed
        into that block's hash, and through the chain into every later one's: the blocks
        before it stay shared with any request of the same leading tokens."""
        if extra is None:
            return 0, False
        bt = self.ns.block_tokens
        marks = dict(marks or {})
        hashes = hash_marked(self.ns, prompt, 0, None, extra, marks)
        loadable = (len(prompt) - 1) // bt   # vLLM must compute at least the last token
        hit = self._matched(hashes[:loadable]) if loadable else 0
        self.requests[req_id] = _Request(hashes, hit, tokens, num_computed_tokens, extra=extra,
                                         marks=marks)
        num_new = max(0, hit * bt - num_computed_tokens)
        return num_new, bool(num_new and self.async_load)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """`update_state_after_alloc`: `block_ids` are all of the request's blocks so far."""
        req = self.requests.get(req_id)
        if req is None:
            return
        req.block_ids = list(block_ids)
        if num_external_tokens > 0:
            bt = self.ns.block_tokens
            first = req.num_local_tokens // bt
            req.load = (first, first + num_external_tokens // bt)
            req.is_async = self.async_load
            self.num_hit_tokens += num_external_tokens

    def build(self, new_reqs, cached, num_scheduled: dict[str, int]) -> KVTierMetadata:
        """This step's loads (pending ones) and saves (prompt blocks this step completes)."""
        meta = KVTierMetadata()
        for new in new_reqs:
            req = self.requests.get(new.req_id)
            if req is not None:
                req.block_ids = list(new.block_ids[0])
                self._step(meta, new.req_id, req, new.num_computed_tokens + num_scheduled.get(new.req_id, 0))
        for i, req_id in enumerate(cached.req_ids):
            req = self.requests.get(req_id)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:  # preempted: blocks were given back
                    req.block_ids, req.num_stored = [], self._recheck(req)
                req.block_ids.extend(new_ids[0])
            self._step(meta, req_id, req, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0))
        for req_id, req in self.requests.items():   # async loads of requests not scheduled yet
            if req.load is not None and req.is_async:
                self._take_load(meta, req_id, req)
        return meta

    def _step(self, meta: KVTierMetadata, req_id: str, req: _Request, num_done_tokens: int) -> None:
        if req.load is not None:
            self._take_load(meta, req_id, req)
        num_full = min(num_done_tokens // self.ns.block_tokens, len(req.block_ids))
        if self.save_decode:
            self._hash_decode_blocks(req, num_full)
        num_full = min(num_full, len(req.hashes))
        if num_full > req.num_stored:
            new = slice(req.num_stored, num_full)
            meta.saves.append(BlockTransfer(req_id, tuple(req.hashes[new]), tuple(req.block_ids[new])))
            req.num_stored = num_full

    def _hash_decode_blocks(self, req: _Request, num_full: int) -> None:
        """Extend the chain over blocks whose tokens are all known (prompt + outputs)."""
        bt = self.ns.block_tokens
        num_full = min(num_full, len(req.tokens) // bt)
        if num_full > len(req.hashes):
            parent = req.hashes[-1] if req.hashes else None
            first = len(req.hashes)  # (an image that starts in the prompt's partial last
            req.hashes += hash_marked(self.ns, list(req.tokens[first * bt:num_full * bt]),  # block
                                      first, parent, req.extra, req.marks)  # marks it here)

    def _take_load(self, meta: KVTierMetadata, req_id: str, req: _Request) -> None:
        first, end = req.load
        meta.loads.append(BlockTransfer(req_id, tuple(req.hashes[first:end]),
                                        tuple(req.block_ids[first:end]), req.is_async))
        req.load = None

    def _recheck(self, req: _Request) -> int:
        return self._matched(req.hashes)

    def _matched(self, hashes: list[bytes]) -> int:
        """The leading blocks the store holds; 0 when it cannot answer (vLLM computes them:
        the exception failed vLLM's scheduler step, and with it every request)."""
        try:
            return self.store.match_prefix(hashes).num_blocks
        except STORE_OUTAGES as e:
            log.warning("the KV store did not answer (%s): computing instead", e)
            return 0

    def finished(self, req_id: str) -> None:
        self.requests.pop(req_id, None)


def hash_marked(ns: Namespace, tokens: Sequence[int], first_block: int, parent: bytes | None,
                extra: bytes, marks: dict[int, bytes]) -> list[bytes]:
    """`hash_blocks` of `tokens`, the request's blocks from `first_block` on, chained from
    `parent`: `extra` mixed into every block, and `marks[k]` into block k too."""
    bt = ns.block_tokens
    n = len(tokens) // bt
    out: list[bytes] = []
    at = 0
    for k in sorted(k for k in marks if first_block <= k < first_block + n):
        i = k - first_block
        if i > at:
            out += hash_blocks(ns, tokens[at * bt:i * bt], out[-1] if out else parent, extra)
        out += hash_blocks(ns, tokens[i * bt:(i + 1) * bt], out[-1] if out else parent,
                           extra + marks[k])
        at = i + 1
    if at < n:
        out += hash_blocks(ns, tokens[at * bt:n * bt], out[-1] if out else parent, extra)
    return out
