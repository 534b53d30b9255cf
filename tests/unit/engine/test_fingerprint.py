"""Which weights a KV namespace names (engine_adapter.fingerprint): checkpoints that share a
name but not their weights never share KV; equal weights anywhere do."""
import json
import logging
import os
import shutil

import pytest
import torch

from engine_adapter.fingerprint import checkpoint_revision, hub_commit, weights_revision

COMMIT_A, COMMIT_B = "a" * 40, "0123456789abcdef0123456789abcdef01234567"


def write_checkpoint(path, seed: int, config: dict | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(torch.randint(0, 256, (3 << 20,), generator=g, dtype=torch.uint8).numpy().tobytes())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config or {"hidden_size": 64}, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(str(seed))  # not part of the fingerprint (token ids are)
    return str(path)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache" / "fingerprints.json")


def test_a_checkpoint_retrained_into_the_same_directory_gets_a_new_revision(tmp_path, cache):
    ckpt = write_checkpoint(tmp_path / "final", seed=1)
    first = checkpoint_revision(ckpt, cache_path=cache)
    assert first.startswith("f-") and checkpoint_revision(ckpt, cache_path=cache) == first
    write_checkpoint(tmp_path / "final", seed=2)  # same size, same names, other bytes
    assert checkpoint_revision(ckpt, cache_path=cache) != first


def test_a_file_rewritten_with_its_old_size_and_times_is_hashed_again(tmp_path, cache):
    ckpt = write_checkpoint(tmp_path / "m", seed=1)
    weights = os.path.join(ckpt, "model.safetensors")
    before = os.stat(weights)
    first = checkpoint_revision(ckpt, cache_path=cache)
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 4096)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # (ctime still moves)
    assert checkpoint_revision(ckpt, cache_path=cache) != first


def test_equal_weights_in_other_places_and_times_share_the_revision(tmp_path, cache):
    a = write_checkpoint(tmp_path / "host-a" / "llama", seed=7)
    b = str(tmp_path / "host-b" / "llama-copy")
    shutil.copytree(a, b)  # (other inodes, other times, other directory name)
    with open(os.path.join(b, "tokenizer.json"), "w") as f:
        f.write("another tokenizer file")
    assert checkpoint_revision(a, cache_path=cache) == checkpoint_revision(b, cache_path=cache)
    # config is part of it: a changed rope or head count changes every KV
    write_checkpoint(b, seed=7, config={"hidden_size": 64, "rope_theta": 5e5})
    assert checkpoint_revision(a, cache_path=cache) != checkpoint_revision(b, cache_path=cache)


def test_the_cache_is_used_and_a_damaged_one_is_rebuilt(tmp_path, cache):
    ckpt = write_checkpoint(tmp_path / "m", seed=3)
    first = checkpoint_revision(ckpt, cache_path=cache)
    with open(cache) as f:
        data = json.load(f)
    assert len(data["files"]) == 2  # config.json and model.safetensors, by file version
    # an entry the cache holds is believed (that is what spares re-reading the weights)
    data["files"] = {k: "0" * 32 for k in data["files"]}
    with open(cache, "w") as f:
        json.dump(data, f)
    assert checkpoint_revision(ckpt, cache_path=cache) != first
    with open(cache, "w") as f:
        f.write("{not json")
    assert checkpoint_revision(ckpt, cache_path=cache) == first
    os.unlink(cache)
    os.makedirs(cache)  # unwritable as a file: still answers, hashing each time
    assert checkpoint_revision(ckpt, cache_path=cache) == first


def test_a_single_file_checkpoint(tmp_path, cache):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    first = checkpoint_revision(str(gguf), cache_path=cache)
    gguf.write_bytes(b"GGUF" + bytes(999) + b"\x01")
    assert checkpoint_revision(str(gguf), cache_path=cache) != first


def test_a_hub_id_is_named_by_the_commit_its_revision_resolves_to(tmp_path, monkeypatch, cache):
    hub = tmp_path / "hub"
    refs = hub / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(COMMIT_A)
    (refs / "v2").write_text(COMMIT_B + "\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)  # (no local directory named org/model)
    assert checkpoint_revision("org/model", cache_path=cache) == "hf-" + COMMIT_A
    assert checkpoint_revision("org/model", "v2", cache_path=cache) == "hf-" + COMMIT_B
    assert checkpoint_revision("org/model", COMMIT_B, cache_path=cache) == "hf-" + COMMIT_B
    (refs / "main").write_text(COMMIT_B)  # main moved on: so does the namespace
    assert checkpoint_revision("org/model", cache_path=cache) == "hf-" + COMMIT_B
    # a download dir the engine names is looked in first
    other = tmp_path / "downloads" / "models--org--model" / "refs"
    other.mkdir(parents=True)
    (other / "main").write_text(COMMIT_A)
    assert checkpoint_revision("org/model", hub_dirs=(str(tmp_path / "downloads"),),
                               cache_path=cache) == "hf-" + COMMIT_A
    # refs that are not commits, and names that would leave the cache, resolve to nothing
    (refs / "bad").write_text("not-a-commit")
    assert hub_commit("org/model", "bad") is None
    assert hub_commit("org/model", "../../models--org--model/refs/main") is None
    assert hub_commit("../x", "main") is None


def test_an_unresolvable_name_falls_back_to_name_and_revision_with_a_warning(
        tmp_path, monkeypatch, caplog, cache):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtier.fingerprint"):
        assert checkpoint_revision("my-served-model", cache_path=cache) == "main"
        assert checkpoint_revision("org/model", "v1", cache_path=cache) == "v1"
    assert "kvtier_revision" in caplog.text


def test_weights_revision_sees_bytes_names_dtypes_and_shapes():
    w = {"a": torch.arange(12, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float16)}
    base = weights_revision(w)
    assert weights_revision({k: v.clone() for k, v in w.items()}) == base
    changed = dict(w, a=w["a"].clone())
    changed["a"][5] += 1e-3
    assert weights_revision(changed) != base
    assert weights_revision({"a2": w["a"], "b": w["b"]}) != base
    assert weights_revision(dict(w, a=w["a"].view(3, 4))) != base
    assert weights_revision(dict(w, b=w["b"].to(torch.bfloat16))) != base
    assert weights_revision(dict(w, empty=torch.empty(0))) != base
