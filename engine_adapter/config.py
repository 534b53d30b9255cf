"""Frozen, validated configs: the model's architecture and the engine's knobs."""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, fields

from engine_adapter.errors import ModelLoadError
from kvstore.keys import CODECS


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


def bool_field(d, key: str, error: type[Exception], name: str) -> bool:
    """A boolean field of a JSON mapping (false when absent or null); anything but a
    boolean raises `error` saying `name` must be true or false (the string "false" was
    read as true: a model's embeddings tied, an answer asked for whole streamed)."""
    value = d.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise error(f"{name} must be true or false, not {value!r}")
    return value


DEFAULT_REVISION = "main"  # names no weights: an engine with a store fingerprints them


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-architecture model: RMSNorm, RoPE, GQA, a gated MLP; optional biases (Llama's
    attention_bias / mlp_bias, Qwen2's q/k/v), sliding-window attention on some layers."""

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
    attention_bias: bool = False           # q/k/v projection biases
    name: str = "llama"
    o_proj_bias: bool = False
    mlp_bias: bool = False                 # gate/up/down projection biases
    hidden_act: str = "silu"               # the gate's activation: SUPPORTED_ACTIVATIONS
    sliding_window: int | None = None      # a query sees this many keys, itself included...
    sliding_layers: tuple[int, ...] = ()   # ...on these layers (the others see everything)
    # which weights of `name`: the KV namespace's revision. A model loaded from a directory
    # or without a name gets a fingerprint of its weights here, so two checkpoints whose
    # names agree (two runs' `final/` directories) never share KV blocks
    revision: str = DEFAULT_REVISION

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):  # ("48" from a config.json)
                raise ModelLoadError(f"ModelConfig.{f} must be an integer, got {v!r}")
            if v <= 0:
                raise ModelLoadError(f"ModelConfig.{f} must be > 0, got {v}")
        for f in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
                    or v == float("inf"):
                # (rope_theta <= 0: every decode step's logits were NaN)
                raise ModelLoadError(f"ModelConfig.{f} must be a finite number > 0, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads ({self.num_heads}) must be a multiple of "
                                 f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ModelLoadError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {self.hidden_act!r} is not implemented "
                                 f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))  # JSON gives lists
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelLoadError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers) or \
                (self.sliding_layers and self.sliding_window is None):
            raise ModelLoadError(f"sliding_layers {self.sliding_layers} need a sliding_window and "
                                 f"layer indices in [0, {self.num_layers})")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None


def kv_settings(cfg: ModelConfig) -> dict:
    """What of a config changes KV besides the weights (not its name and revision)."""
    return {k: v for k, v in asdict(cfg).items() if k not in ("name", "revision")}


class OversizePolicy(enum.Enum):
    """What the engine does with a request whose prompt + max_tokens can outgrow the cache."""

    REFUSE = "refuse"      # InvalidRequestError at submission: it could never finish
    TRUNCATE = "truncate"  # accepted if its prompt fits; ends with `length` when it fills the cache


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
    kv_codec: str = "raw"                  # how blocks are stored: raw, int8, fp8_e4m3, zstd
    save_queue_batches: int = 64           # pending store saves before new ones are dropped
    oversize_policy: OversizePolicy = OversizePolicy.REFUSE   # or its value, "truncate"
    # Later requests that may be admitted ahead of a waiting one whose blocks are not free
    # yet; past that, admission waits for it, so a large request is never starved (0: FCFS).
    max_admission_skips: int = 8

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
        if self.max_admission_skips < 0:
            raise ValueError(f"EngineConfig.max_admission_skips must be >= 0, got {self.max_admission_skips}")
        if self.kv_codec not in CODECS:
            raise ValueError(f"EngineConfig.kv_codec must be one of {', '.join(CODECS)}, "
                             f"got {self.kv_codec!r} (docs/compression.md)")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"EngineConfig.dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        try:
            object.__setattr__(self, "oversize_policy", OversizePolicy(self.oversize_policy))
        except ValueError:
            raise ValueError(f"EngineConfig.oversize_policy must be one of "
                             f"{[p.value for p in OversizePolicy]}, got {self.oversize_policy!r}") from None

    def model_len(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        return limit if self.max_model_len is None else min(limit, self.max_model_len)

    def blocks_per_seq(self, model: ModelConfig) -> int:
        return math.ceil(self.model_len(model) / self.block_tokens)
