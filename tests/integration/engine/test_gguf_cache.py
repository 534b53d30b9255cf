"""load_hf_gguf keeps what transformers made of a GGUF file: a later load gets the same
model (weights bit for bit, config, generation config, output) without de-quantizing again,
and a file changed in place is converted again."""
import os
import shutil

import pytest
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
    import transformers
    real, loads = transformers.AutoModelForCausalLM.from_pretrained, []

    class Converting(BaseException):
        """Raised where the real loader would de-quantize the GGUF file again (~20 s):
        which file the loader went back to is what the last check needs to see."""

    def counted(*a, **kw):  # (the real loader, its GGUF loads counted)
        loads.append(kw.get("gguf_file"))
        if kw.get("gguf_file") is not None:
            raise Converting
        return real(*a, **kw)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", counted)
    cached, cached_tokenizer = load_hf_gguf(str(local), gguf)
    assert loads == [None]  # read from what was kept, not de-quantized again
    want, got = oracle.state_dict(), cached.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert cached.config.to_dict() == oracle.config.to_dict()
    assert cached.generation_config.to_dict() == oracle.generation_config.to_dict()
    text = "The harbour town of Vell sits where <|im_start|>user ünïcode 12345"
    assert cached_tokenizer(text).input_ids == tokenizer(text).input_ids
    ids = tokenizer("The harbour town of Vell sits where", return_tensors="pt").input_ids
    assert torch.equal(cached.generate(ids, max_new_tokens=4, do_sample=False),
                       oracle.generate(ids, max_new_tokens=4, do_sample=False))
    # another file of the same size and times (a copy with `cp -p` of other weights):
    # converted anew, never handed the first one's conversion
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy2(local / gguf, other / gguf)
    with open(other / gguf, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(b"\x01" * 16)
    st = os.stat(local / gguf)
    os.utime(other / gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _gguf_cache_dir(str(other), gguf) not in (_gguf_cache_dir(str(local), gguf), None)
    # a kept conversion damaged on disk is converted again, not a failed load (the
    # conversion itself is the one the first load made: stopped as it starts)
    kept = _gguf_cache_dir(str(local), gguf)
    with open(os.path.join(kept, "model.safetensors"), "r+b") as f:
        f.truncate(1000)
    loads.clear()
    with pytest.raises(Converting):
        load_hf_gguf(str(local), gguf)
    assert loads == [None, gguf]  # the damaged copy tried, then the GGUF file
