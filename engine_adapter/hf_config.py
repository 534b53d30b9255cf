"""A Hugging Face config (Llama, Mistral, Qwen2) read into a `ModelConfig`, or refused.

Every field of these families that changes the math is either implemented (biases, the
activation, Llama-3 RoPE scaling, sliding-window attention per layer) or refused here by
name: a model that loads computes what transformers computes on the same weights. Fields
the transformers model of that family ignores are ignored here too (Llama has no sliding
window, Qwen2 and Mistral have fixed biases), so the oracle and this model agree on them.

Per family, as transformers 5 builds it:

    family   q/k/v bias        o bias            MLP bias   sliding window
    llama    attention_bias    attention_bias    mlp_bias   none
    mistral  no                no                no         sliding_window, every layer
    qwen2    yes               no                no         sliding_window if use_sliding_window,
                                                            on layer_types "sliding_attention"
                                                            (default: layers >= max_window_layers)
"""
from __future__ import annotations

from typing import Any, Mapping

from engine_adapter.config import SUPPORTED_ACTIVATIONS, ModelConfig, RopeScaling, bool_field
from engine_adapter.errors import ModelLoadError

FAMILIES = ("llama", "qwen2", "mistral")
# transformers' defaults for fields a hand-written config.json may leave out
DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6},
    "mistral": {"rms_norm_eps": 1e-6, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28},
}
# Math this model does not implement (fields of Llama-family relatives), by field: refused
# unless absent, None or one of its neutral values.
UNSUPPORTED = {
    "partial_rotary_factor": (1.0,), "rotary_pct": (1.0,), "attn_logit_softcapping": (),
    "final_logit_softcapping": (), "query_pre_attn_scalar": (), "attention_multiplier": (),
    "logits_scaling": (1.0,), "logit_scale": (1.0,), "embedding_multiplier": (1.0,),
    "residual_multiplier": (1.0,), "use_qk_norm": (False,), "qk_layernorm": (False,),
    "use_parallel_residual": (False,), "num_experts": (0,), "num_local_experts": (0,),
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def model_config_from_hf(hf: Any, name: str | None = None) -> ModelConfig:
    """From a transformers config object or its dict (config.json). A field missing or of
    the wrong type is a ModelLoadError naming it."""
    d = hf if isinstance(hf, dict) else hf.to_dict()
    try:
        return _model_config(d, name)
    except ModelLoadError:
        raise
    except KeyError as e:
        raise ModelLoadError(f"config field {e.args[0]} is missing") from e
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"a config field has a value of the wrong type or range: {e}") from e


def _model_config(d: Mapping[str, Any], name: str | None) -> ModelConfig:
    kind = d.get("model_type", "llama")
    if kind not in FAMILIES:
        raise ModelLoadError(f"model_type {kind!r} is not a Llama-architecture model "
                             f"(supported: {', '.join(FAMILIES)})")
    d = {**DEFAULTS[kind], **d}
    _refuse_unsupported(d, kind)
    theta, scaling = _rope(d)
    heads = d["num_attention_heads"]
    window, sliding_layers = _sliding_window(d, kind)
    qkv_bias, o_bias, mlp_bias = _biases(d, kind)
    return ModelConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=float(d["rms_norm_eps"]), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=_flag(d, "tie_word_embeddings"),
        attention_bias=qkv_bias, o_proj_bias=o_bias, mlp_bias=mlp_bias,
        hidden_act=d.get("hidden_act", "silu"), sliding_window=window, sliding_layers=sliding_layers,
        name=name or d.get("_name_or_path") or kind,
    )


def _refuse_unsupported(d: Mapping[str, Any], kind: str) -> None:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise ModelLoadError(f"config field rope_parameters must be a mapping, got {rope!r}")
    for field, neutral in UNSUPPORTED.items():
        value = rope.get(field, d.get(field)) if field == "partial_rotary_factor" else d.get(field)
        if value is not None and value not in neutral:
            raise ModelLoadError(f"config field {field}={value!r} changes the model's math and is "
                                 "not implemented")
    quant = d.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, Mapping) else str(quant)
    if quant and not method.endswith("gguf"):   # transformers de-quantizes GGUF on load
        raise ModelLoadError(f"config field quantization_config ({method or quant!r}): quantized "
                             "weights are not supported; load a float checkpoint")
    if d.get("hidden_act", "silu") not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"config field hidden_act={d['hidden_act']!r} is not implemented "
                             f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    if kind == "mistral" and d.get("layer_types"):
        raise ModelLoadError("config field layer_types: per-layer attention types on a Mistral "
                             "model (Ministral-style alternating attention) are not implemented")


def _rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})  # (a mapping:
    # _refuse_unsupported checked)
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelLoadError(f"config field rope_type={rope_type!r} is not implemented "
                             "(supported: default, llama3)")
    if rope_type == "default":
        return theta, None
    # (transformers fills original_max_position_embeddings in with max_position_embeddings)
    original = rope.get("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
    return theta, RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                              float(rope["high_freq_factor"]), int(original))


def _biases(d: Mapping[str, Any], kind: str) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP bias) as the transformers model of `kind` builds them."""
    if kind == "qwen2":
        return True, False, False
    if kind == "mistral":
        return False, False, False
    attn = _flag(d, "attention_bias")
    return attn, attn, _flag(d, "mlp_bias")


def _flag(d: Mapping[str, Any], field: str) -> bool:
    return bool_field(d, field, ModelLoadError, f"config field {field}")


def _sliding_window(d: Mapping[str, Any], kind: str) -> tuple[int | None, tuple[int, ...]]:
    """(window size, the layers that use it); (None, ()) for full attention everywhere."""
    layers = d["num_hidden_layers"]
    if kind == "llama":
        return None, ()
    window = d.get("sliding_window")
    if kind == "mistral":
        return (None, ()) if window is None else (int(window), tuple(range(layers)))
    if not d.get("use_sliding_window") or window is None:
        return None, ()
    types = d.get("layer_types") or ["sliding_attention" if i >= d["max_window_layers"] else
                                     "full_attention" for i in range(layers)]
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad or len(types) != layers:
        raise ModelLoadError(f"config field layer_types: expected {layers} of {LAYER_TYPES}, "
                             f"got {types!r}")
    return int(window), tuple(i for i, t in enumerate(types) if t == "sliding_attention")
