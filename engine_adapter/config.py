"""Frozen, validated configs: the model's architecture and the engine's knobs."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from engine_adapter.errors import ModelLoadError


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-architecture model: RMSNorm, RoPE, GQA, SwiGLU, optional q/k/v biases (Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    name: str = "llama"

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ModelLoadError(f"ModelConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads ({self.num_heads}) must be a multiple of "
                                 f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ModelLoadError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @classmethod
    def from_hf(cls, hf: Any, name: str | None = None) -> "ModelConfig":
        """From a transformers config object or its dict (Llama, Qwen2 and kin)."""
        d = hf if isinstance(hf, dict) else hf.to_dict()
        kind = d.get("model_type", "llama")
        if kind not in ("llama", "qwen2", "mistral"):
            raise ModelLoadError(f"model_type {kind!r} is not a Llama-architecture model "
                                 "(supported: llama, qwen2, mistral)")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ModelLoadError(f"rope_type {rope_type!r} is not supported (default, llama3)")
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                  float(rope["high_freq_factor"]),
                                  int(rope["original_max_position_embeddings"]))
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)), rope_theta=float(theta),
            rope_scaling=scaling, max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", kind == "qwen2")),
            name=name or d.get("_name_or_path") or kind,
        )


@dataclass(frozen=True)
class EngineConfig:
    """The engine's paged cache and batching limits."""

    num_blocks: int = 512                  # paged KV cache blocks (all layers per block)
    block_tokens: int = 16                 # tokens per block; the store uses the same size
    max_num_seqs: int = 16                 # requests running at once
    max_num_batched_tokens: int = 2048     # tokens per step (prefill chunks + decodes)
    max_prefill_chunk_tokens: int | None = None  # per request per step; None = the whole
    # step budget (a long prefill then holds back decodes and short prefills until it ends)
    max_model_len: int | None = None       # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    dtype: str = "float32"                 # model and KV cache dtype
    device: str = "cpu"
    tenant: str = ""                       # salts block hashes: tenants never share blocks
    save_queue_batches: int = 64           # pending store saves before new ones are dropped

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("num_blocks", "block_tokens", "max_num_seqs", "max_num_batched_tokens",
                          "save_queue_batches") and v <= 0:
                raise ValueError(f"EngineConfig.{f.name} must be > 0, got {v}")
        if self.max_prefill_chunk_tokens is not None and self.max_prefill_chunk_tokens <= 0:
            raise ValueError("EngineConfig.max_prefill_chunk_tokens must be > 0 or None, "
                             f"got {self.max_prefill_chunk_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len must be > 0, got {self.max_model_len}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"EngineConfig.dtype must be float32, float16 or bfloat16, got {self.dtype!r}")

    def model_len(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        return limit if self.max_model_len is None else min(limit, self.max_model_len)

    def blocks_per_seq(self, model: ModelConfig) -> int:
        return math.ceil(self.model_len(model) / self.block_tokens)
