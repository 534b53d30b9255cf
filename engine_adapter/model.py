"""A Llama-architecture decoder running its attention on the paged kernels.

Weights are kept fused (qkv_proj, gate_up_proj): fewer, larger matmuls per layer. Tokens of
every sequence in a step are packed into one flat batch `[num_tokens]`; `AttentionMetadata`
says where each token's K/V goes and which cached context each sequence attends over.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import nn

import kernels
from engine_adapter.config import ModelConfig


# hidden_act -> the function, as transformers' ACT2FN computes it
ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,                                      # exact (erf)
    "gelu_pytorch_tanh": functools.partial(nn.functional.gelu, approximate="tanh"),
    "relu": nn.functional.relu,
}


class AttentionMetadata(NamedTuple):
    slot_mapping: torch.Tensor   # [num_tokens] cache slot of each new token
    block_tables: torch.Tensor   # [batch, max_blocks] int32
    seq_lens: torch.Tensor       # [batch] context after this step (cached + new)
    cu_seqlens_q: torch.Tensor   # [batch + 1] new tokens of sequence b at rows cu[b]:cu[b+1]
    max_query_len: int           # 1 = a pure decode step


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies `[head_dim / 2]`, Llama-3 scaled when configured."""
    exps = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** exps)
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, D]`, cos/sin `[T, 1, D]`; rotate-half convention of HF Llama."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.window = cfg.window_of(layer)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        t, cfg = x.shape[0], self.cfg
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, cfg.num_heads, cfg.head_dim), cos, sin)  # [T, H, D]
        k = apply_rope(k.view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)  # [T, Hkv, D]
        v = v.contiguous().view(t, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        cache = kernels.layer_view(kv_cache, self.layer)
        kernels.write_kv_to_cache(k, v, cache, meta.slot_mapping, check_values=False)
        if meta.max_query_len == 1:
            o = kernels.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens,
                                               sliding_window=self.window, check_values=False)
        else:
            o = kernels.paged_prefill_attention(q, cache, meta.block_tables, meta.cu_seqlens_q,
                                                meta.seq_lens, max_query_len=meta.max_query_len,
                                                sliding_window=self.window, check_values=False)
        return self.o_proj(o.reshape(t, self.q_size))  # [T, H*D] -> [T, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], kv_cache, meta) -> hidden [T, hidden]`;
    `compute_logits(hidden [n, hidden]) -> [n, vocab]` (float32)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
