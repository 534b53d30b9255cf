"""Hugging Face transformers prefix offload: a drop-in for `model.generate(...)`.

    from engine_adapter.plugins.hf import KVTierGenerate
    kv = KVTierGenerate(model, store)          # or StoreSpec(path=...) / StoreSpec(url=...)
    kv = KVTierGenerate(model, spec, codec="int8")   # blocks stored compressed (docs/compression.md)
    out = kv.generate(input_ids, max_new_tokens=32)   # same arguments as model.generate
    kv.last                                    # GenerateStats: tokens loaded vs computed
    # or patch the model in place: enable_kvtier(model, store); model.generate(...)

One call: hash the prompt's full blocks (kvtier's own recipe), ask the store for the longest
stored prefix, load it into a fresh `DynamicCache`, let `generate` compute only the rest, then
save the full blocks of the sequence whose KV the cache now holds. At least one prompt token
is always computed (generate needs logits for the last prompt position). A block that fails
its checksum is a miss: the prefix ends before it and the rest is recomputed.
Batches of more than one row, or calls that bring their own cache, run plain `generate`.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, NamedTuple

import torch

from engine_adapter.fingerprint import weights_revision
from engine_adapter.plugins.base import STORE_OUTAGES, StoreSpec, coded, dtype_name, open_store
from kvstore.api import BlockStore, leading_hits
from kvstore.keys import Namespace, hash_blocks

log = logging.getLogger("kvtier.hf")


class GenerateStats(NamedTuple):
    num_prompt_tokens: int
    num_loaded_tokens: int    # prefix KV taken from kvtier
    num_computed_tokens: int  # prompt tokens the model ran a forward pass over
    num_saved_blocks: int     # blocks handed to the store after generating (new or not)
    bypassed: bool            # plain generate ran: batch > 1, a caller-owned cache, padding
    # in the attention mask, inputs_embeds or any other model input (images, audio...),
    # use_cache off, a model whose cache is not plain per-layer K/V (sliding windows, SSM
    # or linear-attention layers), or more than one sequence generated (beams,
    # num_return_sequences, assisted or contrastive)


def namespace_for(model, model_id: str | None = None, block_tokens: int = 16, tenant: str = "",
                  codec: str = "raw", revision: str | None = None) -> Namespace:
    """The kvtier namespace of a transformers decoder (its KV layout and dtype). Its
    revision is `revision` if given (the caller's word for which weights these are), else a
    fingerprint of the model's weights as they are in memory: a name (`model_id`, the
    config's `_name_or_path`) does not say which weights, and two checkpoints of one name
    must not share KV."""
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return Namespace(
        model=model_id or cfg._name_or_path or type(model).__name__,
        num_layers=cfg.num_hidden_layers, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim, dtype=dtype_name(model.dtype), block_tokens=block_tokens, tenant=tenant,
        codec=codec, revision=revision or model_revision(model))


def model_revision(model) -> str:
    """A fingerprint of the model as it runs: its weights and buffers (rotary frequencies
    too, which the state dict leaves out) and its config (rope, norm epsilon...)."""
    tensors = dict(model.state_dict())
    tensors.update((f"buffer:{k}", v) for k, v in model.named_buffers())
    return weights_revision(tensors, model.config.to_dict())


def cache_to_blocks(cache, num_blocks: int, block_tokens: int, first_block: int = 0) -> torch.Tensor:
    """Blocks [first_block, num_blocks) of a batch-1 cache -> [n, L, 2, bt, Hkv, D]
    contiguous (only those blocks are copied: a save after a long loaded prefix is cheap)."""
    lo, hi, n = first_block * block_tokens, num_blocks * block_tokens, num_blocks - first_block
    k = torch.stack([layer.keys[0, :, lo:hi] for layer in cache.layers])      # [L, Hkv, T, D]
    v = torch.stack([layer.values[0, :, lo:hi] for layer in cache.layers])
    kv = torch.stack((k, v), dim=1)                                           # [L, 2, Hkv, T, D]
    L, _, H, _, D = kv.shape
    kv = kv.view(L, 2, H, n, block_tokens, D)
    return kv.permute(3, 0, 1, 4, 2, 5).contiguous()                          # [n, L, 2, bt, Hkv, D]


def blocks_to_cache(blocks: torch.Tensor, config) -> Any:
    """[n, L, 2, bt, Hkv, D] -> a DynamicCache holding those n*bt tokens (batch 1)."""
    from transformers import DynamicCache
    n, L, _, bt, H, D = blocks.shape
    kv = blocks.permute(1, 2, 4, 0, 3, 5).reshape(L, 2, 1, H, n * bt, D)     # [L, 2, B=1, Hkv, T, D]
    cache = DynamicCache(config=config)
    for layer_idx in range(L):
        cache.update(kv[layer_idx, 0].contiguous(), kv[layer_idx, 1].contiguous(), layer_idx)
    return cache


def _full_attention_only(model) -> bool:
    """Whether the model's cache is exactly one plain K/V layer per decoder layer, each
    keeping the whole sequence: no sliding-window layer (built from the config's
    `sliding_window` / `layer_types`), and none holding other state (a hybrid model's SSM or
    conv state, a linear-attention layer), which blocks of K/V cannot carry: Falcon-H1
    loaded its prefix's K/V without its SSM state and generated other tokens, LFM2 failed
    every call after generating."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    cache = DynamicCache(config=model.config)
    layers = getattr(cache, "layers", ())
    return (len(layers) == model.config.get_text_config(decoder=True).num_hidden_layers
            and all(type(layer) is DynamicLayer for layer in layers))


# generate's arguments that change neither the model's inputs nor its KV (decoding
# settings, outputs, callbacks); a model input among the rest (pixel_values, audio
# features, token_type_ids...) makes KV that is not a function of the token ids alone
_NOT_MODEL_INPUTS = frozenset(("attention_mask", "use_cache", "return_dict",
                               "output_attentions", "output_hidden_states", "logits_to_keep",
                               "num_logits_to_keep", "labels"))


class KVTierGenerate:
    """`generate` with kvtier prefix offload for one transformers model."""

    def __init__(self, model, store: BlockStore | StoreSpec, *, model_id: str | None = None,
                 block_tokens: int = 16, tenant: str = "", codec: str = "raw",
                 revision: str | None = None) -> None:
        """`store`: a StoreSpec, or a store of this model's namespace (with `codec`, which
        this wrapper encodes before each put and decodes after each get). `revision`: a
        name for these weights (default: a fingerprint of them, ~0.1 s a GB, taken here;
        weights changed in place afterwards need a new KVTierGenerate)."""
        self.model = model
        self.ns = namespace_for(model, model_id, block_tokens, tenant, codec, revision)
        self.owns_store = isinstance(store, StoreSpec)
        if not self.owns_store and getattr(getattr(store, "ns", self.ns), "codec") != codec:
            raise ValueError(f"the store's namespace holds {store.ns.codec} blocks, not {codec}: "
                             f"pass codec={store.ns.codec!r}")
        self.store = open_store(self.ns, store) if self.owns_store else coded(store, self.ns)
        self._plain_generate = model.generate
        self.last: GenerateStats | None = None
        self._staging = torch.empty((0, *self.ns.block_shape), dtype=model.dtype)  # grow-only
        self._full_attention = _full_attention_only(model)
        self._model_inputs = _model_inputs(model)

    def generate(self, input_ids: torch.Tensor | None = None, **kwargs):
        if input_ids is None:
            input_ids = kwargs.pop("input_ids", None)
        if not self._offloadable(input_ids, kwargs):
            n = 0 if input_ids is None else input_ids.shape[-1]
            self.last = GenerateStats(n, 0, n, 0, True)
            if input_ids is None:
                return self._plain_generate(**kwargs)
            return self._plain_generate(input_ids, **kwargs)
        tokens = input_ids[0].tolist()
        bt = self.ns.block_tokens
        hashes = hash_blocks(self.ns, tokens[:len(tokens) - 1])  # keep >= 1 token to compute
        cache, num_loaded = self._load_prefix(hashes)
        kwargs["cache"] = cache
        # (a generation config's return_dict_in_generate was not looked at: a tensor came
        # back where plain generate returns its output object)
        want_dict = bool(self._setting(kwargs, "return_dict_in_generate"))
        kwargs["return_dict_in_generate"] = True
        kwargs.setdefault("use_cache", True)
        kwargs.pop("cache_implementation", None)  # ("dynamic": the cache passed is one)
        out = self._plain_generate(input_ids, **kwargs)
        try:
            num_saved = self._save(out.sequences[0].tolist(), out.cache, num_loaded // bt)
        except Exception:  # noqa: BLE001 - the output is whole: a failed save costs the save
            log.exception("this call's KV blocks could not be saved (its output stands)")
            num_saved = 0
        self.last = GenerateStats(len(tokens), num_loaded, len(tokens) - num_loaded, num_saved, False)
        return out if want_dict else out.sequences

    def _offloadable(self, input_ids, kwargs) -> bool:
        """Whether this call's KV is a function of its token ids alone, as block hashes
        assume: one sequence of ids (not inputs_embeds), no cache of the caller's, no padding
        (left padding shifts every position: the same ids get other KV), every layer
        holding the whole sequence (a sliding-window layer keeps only its window), and one
        sequence generated from it, by plain greedy or sampled decoding. Beam search and
        num_return_sequences widen the batch inside generate: row 0 of the cache was saved
        under the hashes of the best sequence (another beam's KV, loaded by a later call on
        that text), and a loaded one-row cache met the widened batch and crashed. Assisted
        and contrastive decoding rewrite the cache as they go."""
        mask = kwargs.get("attention_mask")
        return (input_ids is not None and input_ids.shape[0] == 1 and self._full_attention
                # another model input (an image, audio) makes KV the ids do not name: an
                # image's KV was saved under its placeholder ids and loaded by text calls
                and not any(k in self._model_inputs and v is not None
                            for k, v in kwargs.items())
                # with use_cache off generate recomputes the whole sequence each step and
                # appended every pass to the cache passed: other tokens' KV saved
                and self._setting(kwargs, "use_cache") is not False
                and kwargs.get("cache") is None and kwargs.get("past_key_values") is None
                and kwargs.get("inputs_embeds") is None
                # positions of the caller's change the keys (RoPE) but not the token ids:
                # saved under the ids' hashes, later plain calls loaded that KV
                and kwargs.get("position_ids") is None and kwargs.get("cache_position") is None
                # (generate refuses a cache_implementation beside the cache this wrapper
                # passes: any in a generation config failed every call; one in the call
                # that asks for what the wrapper passes, "dynamic", is taken off it)
                and kwargs.get("cache_implementation") in (None, "dynamic")
                and getattr(self._config(kwargs), "cache_implementation", None) is None
                and (mask is None or bool(torch.all(mask != 0)))
                and self._one_plain_sequence(kwargs))

    def _config(self, kwargs):
        return kwargs.get("generation_config") or getattr(self.model, "generation_config", None)

    def _setting(self, kwargs, name: str):
        """A generation setting as generate will see it: the call's, else the generation
        config passed, else the model's."""
        if name in kwargs:
            return kwargs[name]
        return getattr(self._config(kwargs), name, None)

    def _one_plain_sequence(self, kwargs) -> bool:
        """What generate will do with `kwargs` (over the generation config passed, or the
        model's): one beam, one sequence returned, no assistant or lookup, no contrastive
        search."""
        def setting(name: str):
            return self._setting(kwargs, name)
        return ((setting("num_beams") or 1) == 1 and (setting("num_return_sequences") or 1) == 1
                and kwargs.get("assistant_model") is None
                and not setting("prompt_lookup_num_tokens") and not setting("penalty_alpha"))

    def _load_prefix(self, hashes) -> tuple[Any, int]:
        from transformers import DynamicCache
        try:
            hit = self.store.match_prefix(hashes).num_blocks if hashes else 0
            if hit == 0:
                return DynamicCache(config=self.model.config), 0
            if self._staging.shape[0] < hit:   # reused: fresh pages cost a first touch a call
                self._staging = torch.empty((hit, *self.ns.block_shape), dtype=self.model.dtype)
            blocks = self._staging[:hit]
            found = self.store.get_n(hashes[:hit], blocks)
        except STORE_OUTAGES as e:
            log.warning("the KV store did not answer (%s): computing the whole prompt", e)
            return DynamicCache(config=self.model.config), 0
        good = leading_hits(found)  # a miss ends it
        if good == 0:
            return DynamicCache(config=self.model.config), 0
        device = next(self.model.parameters()).device
        return blocks_to_cache(blocks[:good].to(device), self.model.config), good * self.ns.block_tokens

    def _save(self, sequence: list[int], cache, num_loaded_blocks: int) -> int:
        """Store the full blocks whose KV the cache holds, past those just loaded: only when
        it holds exactly the sequence but its last token (what generate leaves), each layer
        K and V of the namespace's shape (MLA's K and V of two widths are not)."""
        num_cached = cache.get_seq_length()
        shape = (1, self.ns.num_kv_heads, num_cached, self.ns.head_dim)
        if num_cached != len(sequence) - 1 or any(
                tuple(layer.keys.shape) != shape or tuple(layer.values.shape) != shape
                for layer in cache.layers):
            log.warning("the cache generate left does not hold this sequence's K/V as kvtier "
                        "blocks do (%d positions for %d tokens): nothing saved", num_cached,
                        len(sequence))
            return 0
        hashes = hash_blocks(self.ns, sequence[:num_cached])
        if len(hashes) <= num_loaded_blocks:
            return 0
        blocks = cache_to_blocks(cache, len(hashes), self.ns.block_tokens, num_loaded_blocks).cpu()
        try:
            self.store.put_n(hashes[num_loaded_blocks:], blocks)
        except STORE_OUTAGES as e:  # (the output was lost with it: it is whole, so it goes back)
            log.warning("the KV store did not answer (%s): this call's blocks are not saved", e)
            return 0
        return len(hashes) - num_loaded_blocks

    def close(self) -> None:
        if self.owns_store:
            self.store.close()
            self.store = None


def _model_inputs(model) -> frozenset[str]:
    """The keyword inputs of the model's forward (its `generate` passes these on), less
    input_ids and the ones that change no KV."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    # (the ones _offloadable looks at itself: the cache and positions)
    return frozenset(named) - _NOT_MODEL_INPUTS - {"input_ids", "cache", "past_key_values",
                                                    "cache_position", "position_ids",
                                                    "inputs_embeds"}


def enable_kvtier(model, store: BlockStore | StoreSpec, **options) -> KVTierGenerate:
    """Patch `model.generate` in place; returns the wrapper (its `.last` has the stats)."""
    wrapper = KVTierGenerate(model, store, **options)
    model.generate = wrapper.generate
    return wrapper
