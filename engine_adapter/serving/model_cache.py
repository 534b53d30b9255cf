"""SmolLM2 converted once, then loaded in seconds by every worker.

`load_smollm2()` de-quantizes the GGUF file through transformers (~17 s on the 2-core
box, more under load), and a cluster starts several workers at once on the same cores. The
launcher converts once (`ensure_cached`), saving our model's own weights (safetensors),
its `ModelConfig` and the tokenizer under `$KVTIER_CACHE` (default `~/.cache/kvtier`),
keyed by the GGUF file's size and mtime; workers then `load_cached`. The weights are the
same float32 tensors `load_smollm2()` produces.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

from engine_adapter.config import ModelConfig, RopeScaling
from kvstore import env
from engine_adapter.loader import load_smollm2, smollm2_path


def cache_dir() -> str:
    path, gguf = smollm2_path()
    st = os.stat(os.path.join(path, gguf))
    root = env.cache_root()
    return os.path.join(root, f"smollm2-{st.st_size}-{int(st.st_mtime)}")


def ensure_cached() -> str:
    """Convert the bundled SmolLM2 once; returns the cache directory."""
    from safetensors.torch import save_model

    final = cache_dir()
    if os.path.exists(os.path.join(final, "done")):
        return final
    model, tokenizer = load_smollm2()
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
    try:
        save_model(model, os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(model.config), f)
        tokenizer.save_pretrained(tmp)
        open(os.path.join(tmp, "done"), "w").close()
        os.replace(tmp, final)  # atomic: a reader sees all of it or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(final, "done")):
            raise
    return final


def load_tokenizer():
    import warnings

    from transformers import AutoTokenizer
    with warnings.catch_warnings():  # transformers' own rope_scaling deprecation, not ours
        warnings.simplefilter("ignore", FutureWarning)
        return AutoTokenizer.from_pretrained(ensure_cached())


def load_cached():
    """(our model, tokenizer) of SmolLM2-135M-Instruct, from the cache (made if missing)."""
    import torch
    from safetensors.torch import load_model

    from engine_adapter.model import LlamaForCausalLM

    d = ensure_cached()
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("rope_scaling"):
        cfg["rope_scaling"] = RopeScaling(**cfg["rope_scaling"])
    model = LlamaForCausalLM(ModelConfig(**cfg))
    load_model(model, os.path.join(d, "model.safetensors"))
    return model.to(torch.float32).eval(), load_tokenizer()
