"""Our model on the paged kernels vs transformers on the same weights (fp32, all positions)."""
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

import kernels
from engine_adapter.loader import from_hf_dir, from_transformers
from engine_adapter.model import AttentionMetadata

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = [  # (family, heads, kv heads, head_dim, tied, rope)
    ("llama", 4, 2, 16, True, None),
    ("llama", 8, 1, 8, False, LLAMA3_ROPE),
    ("llama", 4, 4, 32, False, None),
    ("qwen2", 6, 2, 16, False, None),
    ("qwen2", 4, 1, 24, True, None),
]


FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM)}


def make_hf(family, heads, kv_heads, head_dim, tied, rope, seed=0, **extra):
    """A random-weight transformers model (fp32) of `family`; `extra` config fields."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
              max_position_embeddings=256, tie_word_embeddings=tied)
    kw.update(extra)
    if rope:
        kw["rope_parameters"] = rope
    cfg_cls, model_cls = FAMILIES[family]
    hf = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)  # larger than the init default: far from uniform logits
    return hf


def run_chunks(model, ids, chunks, block_tokens=8):
    """Prefill `ids` in consecutive chunks over one paged sequence; logits of every token."""
    cfg = model.config
    cache = kernels.allocate_kv_cache(16, cfg.num_layers, block_tokens, cfg.num_kv_heads,
                                      cfg.head_dim, torch.float32)
    table = torch.randperm(16)[: -(-len(ids) // block_tokens)].to(torch.int32)  # scattered blocks
    out, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        slots = table[pos // block_tokens].long() * block_tokens + pos % block_tokens
        meta = AttentionMetadata(slots, table[None], torch.tensor([start + n]),
                                 torch.tensor([0, n], dtype=torch.int32), n)
        out.append(model.compute_logits(model(ids[start:start + n], pos, cache, meta)))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}kv{c[2]}d{c[3]}")
def test_logits_match_transformers(case):
    hf = make_hf(*case)
    ours = from_transformers(hf)
    ids = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    # one prefill; a cached prefix + chunk; then single-token decode steps
    for chunks in ([45], [16, 29], [20, 5, 1, 1, 1, 17]):
        got = run_chunks(ours, ids, chunks)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_loads_a_hf_directory_of_safetensors(tmp_path):
    hf = make_hf(*CASES[3])
    hf.save_pretrained(tmp_path)
    ours = from_hf_dir(str(tmp_path))
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(run_chunks(ours, ids, [20]), ref, atol=2e-5, rtol=1e-5)
    assert ours.config.attention_bias
