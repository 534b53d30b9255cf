"""Every config is right or refused: biases, activations and sliding windows against
transformers on the same random weights (fp32), and the fields and weights the model does
not implement refused by name at load."""
import importlib.util
import os

import pytest
import torch

from engine_adapter.config import ModelConfig
from engine_adapter.errors import ModelLoadError
from engine_adapter.loader import from_hf_dir, from_state_dict, from_transformers
from engine_adapter.hf_config import model_config_from_hf


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model_tests = _load("test_model")   # make_hf and run_chunks
make_hf, run_chunks = model_tests.make_hf, model_tests.run_chunks

# (family, extra config fields); 3 layers so Qwen2's max_window_layers splits them
MATRIX = {
    "llama-attention_bias": ("llama", dict(attention_bias=True)),
    "llama-mlp_bias": ("llama", dict(mlp_bias=True)),
    "llama-both-biases-gelu": ("llama", dict(attention_bias=True, mlp_bias=True, hidden_act="gelu")),
    "llama-gelu": ("llama", dict(hidden_act="gelu")),
    "llama-gelu_pytorch_tanh": ("llama", dict(hidden_act="gelu_pytorch_tanh")),
    "llama-relu": ("llama", dict(hidden_act="relu")),
    "mistral-sliding_window-6": ("mistral", dict(sliding_window=6)),
    "mistral-sliding_window-20": ("mistral", dict(sliding_window=20)),
    "qwen2-use_sliding_window": ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1)),
    "qwen2-sliding_window-off": ("qwen2", dict(use_sliding_window=False, sliding_window=3)),
}


def hf_model(case):
    family, extra = MATRIX[case]
    return make_hf(family, 4, 2, 16, False, None, seed=len(case), num_hidden_layers=3, **extra)


@pytest.mark.parametrize("case", MATRIX)
def test_config_variant_matches_transformers(case):
    hf = hf_model(case)
    ours = from_transformers(hf)
    ids = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    # one prefill; a cached prefix + chunk; single-token decode steps past the window
    for chunks in ([45], [16, 29], [20, 5, 1, 1, 1, 17]):
        torch.testing.assert_close(run_chunks(ours, ids, chunks), ref, atol=3e-5, rtol=1e-5)


def test_the_sliding_window_is_really_applied():
    """Same weights without the window give other logits: the matrix above can fail."""
    hf = hf_model("mistral-sliding_window-6")
    ours = from_transformers(hf)
    assert ours.config.sliding_window == 6 and ours.config.sliding_layers == (0, 1, 2)
    qwen = from_transformers(hf_model("qwen2-use_sliding_window")).config
    assert qwen.sliding_layers == (1, 2) and qwen.window_of(0) is None and qwen.window_of(2) == 7
    hf.config.sliding_window = None
    ids = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = hf(ids[None]).logits[0]
    assert (run_chunks(ours, ids, [30]) - full).abs().max() > 1e-2


def test_a_mistral_directory_keeps_its_window(tmp_path):
    hf = hf_model("mistral-sliding_window-6")
    hf.save_pretrained(tmp_path)
    ours = from_hf_dir(str(tmp_path))
    ids = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(run_chunks(ours, ids, [13, 17]), ref, atol=3e-5, rtol=1e-5)


def llama_dict(**fields):
    return {"model_type": "llama", "vocab_size": 300, "hidden_size": 48, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **fields}


@pytest.mark.parametrize("fields,named", [
    (dict(hidden_act="gelu_new"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_type"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(partial_rotary_factor=0.25), "partial_rotary_factor"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(num_local_experts=8), "num_local_experts"),
    (dict(model_type="mistral", layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, layer_types=["chunked", "full_attention"]),
     "layer_types"),
    (dict(model_type="gemma"), "model_type"),
])
def test_a_field_whose_math_is_not_implemented_is_refused_by_name(fields, named):
    with pytest.raises(ModelLoadError, match=named):
        model_config_from_hf(llama_dict(**fields))


def test_neutral_values_and_gguf_load():
    cfg = model_config_from_hf(llama_dict(partial_rotary_factor=1.0, num_local_experts=0,
                                         quantization_config={"quant_method": "gguf"}))
    assert cfg.hidden_act == "silu" and cfg.sliding_window is None


def test_weights_the_config_has_no_use_for_are_an_error():
    hf = hf_model("llama-attention_bias")
    state = hf.state_dict()
    hf.config.attention_bias = False          # the config forgets the biases the weights have
    with pytest.raises(ModelLoadError, match=r"12 weights .* not used .*self_attn\.[kqov]_proj\.bias"):
        from_state_dict(model_config_from_hf(hf.config), state)
    extra = {**make_hf("llama", 4, 2, 16, False, None, num_hidden_layers=3).state_dict(),
             "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    with pytest.raises(ModelLoadError, match="q_norm"):
        from_state_dict(model_config_from_hf(hf.config), extra)


def test_missing_weights_are_named():
    hf = hf_model("llama-mlp_bias")
    state = {k: v for k, v in hf.state_dict().items() if not k.endswith("layers.1.mlp.up_proj.bias")}
    with pytest.raises(ModelLoadError, match=r"missing \['layers.1.mlp.up_proj.bias'\]"):
        from_state_dict(model_config_from_hf(hf.config), state)


def test_checkpoints_sharing_a_directory_name_get_their_own_kv_namespace(tmp_path):
    """from_hf_dir named the model after its directory alone: two runs' `final/`
    checkpoints got one KV namespace, and one model was handed the other's KV."""
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from engine_adapter.config import EngineConfig
    from engine_adapter.engine import LLMEngine
    from engine_adapter.loader import from_hf_dir
    dirs = []
    for i, run in enumerate(("run1", "run2")):
        torch.manual_seed(100 + i)
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256)
        path = tmp_path / run / "final"
        HFLlama(cfg).save_pretrained(path, safe_serialization=True)
        dirs.append(str(path))
    a, b, a_again = from_hf_dir(dirs[0]), from_hf_dir(dirs[1]), from_hf_dir(dirs[0])
    ecfg = EngineConfig(num_blocks=16, block_tokens=4, max_num_batched_tokens=64)
    ns = [LLMEngine(m, ecfg).ns for m in (a, b, a_again)]
    assert a.config.name == b.config.name == "final"
    assert ns[0] != ns[1] and ns[0].ns_id != ns[1].ns_id
    assert ns[0] == ns[2]  # the same weights: the same blocks, in any process


def _logits(model, ids):
    with torch.no_grad():
        return model(ids[None]).logits[0]


def test_a_tied_config_with_a_head_of_its_own_uses_that_head_as_transformers_does(tmp_path):
    """config.json says tie_word_embeddings, the weights hold an lm_head that differs from
    the embedding: transformers 5 leaves them untied and uses the stored head. The loader
    dropped it for the embedding: other logits (up to 1.3 off), other tokens."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    make_hf("llama", 4, 2, 16, False, None, seed=11).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    cfg["tie_word_embeddings"] = True
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)  # the oracle's
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(4))
    ref = _logits(hf, ids)
    for ours in (from_hf_dir(str(tmp_path)), from_transformers(hf)):
        torch.testing.assert_close(run_chunks(ours, ids, [12, 8]), ref, atol=3e-5, rtol=1e-5)
    # tied, and a stored head of the wrong shape: refused (transformers refuses it too)
    w = load_file(tmp_path / "model.safetensors")
    w["lm_head.weight"] = torch.zeros(3, 3)
    save_file(w, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lm_head"):
        from_hf_dir(str(tmp_path))
    # and a truly tied checkpoint still loads as tied
    tied = make_hf("llama", 4, 2, 16, True, None, seed=12)
    torch.testing.assert_close(run_chunks(from_transformers(tied), ids, [20]), _logits(tied, ids),
                               atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("names,shapes", [
    (("q_proj", "k_proj", "v_proj"), ((32, 48),) * 3),  # 96 rows joined, as 64 + 16 + 16 are
    (("gate_proj", "up_proj"), ((40, 48), (152, 48))),  # 192 joined, as 96 + 96
    (("k_proj",), ((32, 49),)),  # (the join itself failed: a bare RuntimeError)
])
def test_projections_of_the_wrong_sizes_are_refused_even_when_joined_they_fit(names, shapes):
    hf = make_hf("llama", 4, 2, 16, False, None, seed=13, hidden_size=48)
    state = dict(hf.state_dict())
    for name, shape in zip(names, shapes):
        part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj")) else "mlp"
        state[f"model.layers.0.{part}.{name}.weight"] = torch.zeros(shape)
    with pytest.raises(ModelLoadError, match=f"{names[0]}.weight has shape"):
        from_state_dict(model_config_from_hf(hf.config), state)


def test_a_directory_loads_the_shards_its_index_names_and_nothing_else(tmp_path):
    """Every *.safetensors was loaded, in name order: a stray backup with the same tensor
    names overrode the real shards (logits 4.5 off), and Mistral's consolidated.safetensors
    beside the Hugging Face weights failed the load."""
    from safetensors.torch import save_file
    hf = make_hf("llama", 4, 2, 16, False, None, seed=14)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    junk = {k: torch.randn_like(v) for k, v in hf.state_dict().items()}
    save_file(junk, tmp_path / "model-old-backup.safetensors")
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, tmp_path / "consolidated.safetensors")
    ids = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(run_chunks(from_hf_dir(str(tmp_path)), ids, [16]),
                               _logits(hf, ids), atol=3e-5, rtol=1e-5)
    single = tmp_path / "single"
    hf.save_pretrained(single)  # one model.safetensors: that file alone, whatever else is
    save_file(junk, single / "z-backup.safetensors")  # there (a stale index too: as
    save_file(junk, single / "model-00001-of-00001.safetensors")  # transformers does)
    (single / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}')
    torch.testing.assert_close(run_chunks(from_hf_dir(str(single)), ids, [16]),
                               _logits(hf, ids), atol=3e-5, rtol=1e-5)
    os.remove(single / "model.safetensors.index.json")
    os.remove(single / "model-00001-of-00001.safetensors")
    os.rename(single / "model.safetensors", single / "weights.safetensors")
    with pytest.raises(ModelLoadError, match="2 \\*.safetensors files .* no model.safetensors.index.json"):
        from_hf_dir(str(single))  # two candidates, nothing saying which


@pytest.mark.parametrize("fields,named", [
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"hidden_size": "48"}, "hidden_size|wrong type"),
    ({"rope_parameters": "default"}, "rope_parameters"),
    ({"rope_theta": 0.0}, "rope_theta"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"num_attention_heads": 4.0}, "num_heads"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"attention_bias": 1}, "attention_bias"),
])
def test_a_config_field_missing_or_of_the_wrong_type_is_a_load_error(fields, named):
    d = llama_dict(**fields)
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(ModelLoadError, match=named):
        model_config_from_hf(d)


def test_llama3_rope_without_its_original_length_takes_the_models_as_transformers_does():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = model_config_from_hf(llama_dict(rope_parameters=rope, max_position_embeddings=777))
    assert cfg.rope_scaling.original_max_position_embeddings == 777


def test_an_engine_dtype_the_model_cannot_run_in_is_named(tmp_path):
    make_hf("llama", 4, 2, 16, False, None, seed=15).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="dtype 'float64'"):
        from_hf_dir(str(tmp_path), dtype="float64")
