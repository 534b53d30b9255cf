"""load_hf_gguf keeps what transformers made of a GGUF file: a later load gets the same
model (weights bit for bit, config, generation config, output) without de-quantizing again,
and a file changed in place is converted again."""
import os
import shutil

import torch

from engine_adapter.loader import _gguf_cache_dir, load_hf_gguf, smollm2_path


def test_the_kept_conversion_is_the_model_transformers_loads_from_the_gguf_file(tmp_path, monkeypatch):
    path, gguf = smollm2_path()
    local = tmp_path / "m"
    local.mkdir()
    shutil.copy(os.path.join(path, gguf), local / gguf)
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path / "cache"))
    # the first load is transformers' own from the GGUF file (the oracle), kept as it is
    oracle, tokenizer = load_hf_gguf(str(local), gguf)
    kept = list((tmp_path / "cache" / "hf-gguf").iterdir())
    assert len(kept) == 1 and (kept[0] / "done").exists()
    cached, _ = load_hf_gguf(str(local), gguf)
    want, got = oracle.state_dict(), cached.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert cached.config.to_dict() == oracle.config.to_dict()
    assert cached.generation_config.to_dict() == oracle.generation_config.to_dict()
    ids = tokenizer("The harbour town of Vell sits where", return_tensors="pt").input_ids
    assert torch.equal(cached.generate(ids, max_new_tokens=4, do_sample=False),
                       oracle.generate(ids, max_new_tokens=4, do_sample=False))
    # the file changed (another quantization saved under the same name): converted anew
    before = _gguf_cache_dir(str(local), gguf)
    os.utime(local / gguf, ns=(1, 10**18))
    assert _gguf_cache_dir(str(local), gguf) not in (before, None)
