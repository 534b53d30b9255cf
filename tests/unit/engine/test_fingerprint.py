"""Which weights a KV namespace names (engine_adapter.fingerprint): checkpoints that share a
name but not their weights never share KV; equal weights anywhere do."""
import json
import logging
import os
import shutil

import pytest
import torch

from engine_adapter.fingerprint import checkpoint_revision, hub_cache_root, hub_commit, weights_revision

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


def test_a_rewrite_the_filesystem_shows_with_the_old_size_and_times_is_seen(tmp_path, cache,
                                                                           monkeypatch):
    """NFS can show a file rewritten in place at its size with the times it had (times of a
    second's grain, the attribute cache): a sample of the file's bytes is part of the key
    its digest is remembered by, so the retrained weights are hashed again."""
    ckpt = write_checkpoint(tmp_path / "m", seed=1)
    weights = os.path.join(ckpt, "model.safetensors")
    shown, real_stat = os.stat(weights), os.stat
    first = checkpoint_revision(ckpt, cache_path=cache)
    write_checkpoint(tmp_path / "m", seed=2)
    monkeypatch.setattr(os, "stat", lambda p, *a, **kw: shown if str(p) == weights
                        else real_stat(p, *a, **kw))
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
    monkeypatch.chdir(tmp_path)  # (no local directory named org/model)
    rev = lambda *a, **kw: checkpoint_revision(*a, hub_dir=str(hub), cache_path=cache, **kw)  # noqa: E731
    assert rev("org/model") == "hf-" + COMMIT_A
    assert rev("org/model", "v2") == "hf-" + COMMIT_B
    assert rev("org/model", COMMIT_B) == "hf-" + COMMIT_B
    (refs / "main").write_text(COMMIT_B)  # main moved on: so does the namespace
    assert rev("org/model") == "hf-" + COMMIT_B
    # the engine's settings on top of the checkpoint (overrides, quantization) count too
    assert rev("org/model", extra=b"rope x2") not in (rev("org/model"), rev("org/model", extra=b"fp8"))
    # one cache, the engine's: another cache's refs may be stale
    (tmp_path / "other" / "models--org--model" / "refs").mkdir(parents=True)
    assert hub_commit("org/model", "main", str(tmp_path / "other")) is None
    # single-name repos too; refs that are not commits, and names that would leave the
    # cache, resolve to nothing
    (hub / "models--gpt2" / "refs").mkdir(parents=True)
    (hub / "models--gpt2" / "refs" / "main").write_text(COMMIT_A)
    assert hub_commit("gpt2", "main", str(hub)) == COMMIT_A
    (refs / "bad").write_text("not-a-commit")
    assert hub_commit("org/model", "bad", str(hub)) is None
    assert hub_commit("org/model", "../../models--org--model/refs/main", str(hub)) is None
    assert hub_commit("../x", "main", str(hub)) is None


def test_the_hub_cache_is_huggingface_hubs_own():
    from huggingface_hub import constants
    assert hub_cache_root() == constants.HF_HUB_CACHE


def test_files_that_change_kv_count_and_files_that_cannot_do_not(tmp_path, cache):
    base = write_checkpoint(tmp_path / "a", seed=4)
    rev = lambda: checkpoint_revision(base, cache_path=cache)  # noqa: E731
    first = rev()
    for name in ("README.md", "generation_config.json", "tokenizer_config.json",
                 "optimizer.pt", ".gitattributes"):
        (tmp_path / "a" / name).write_text("anything")
        assert rev() == first, name
    for name in ("adapter_config.json", "hf_quant_config.json", "model.tensors",
                 "flax_model.msgpack", "original/consolidated.00.pth"):
        os.makedirs(os.path.dirname(os.path.join(base, name)), exist_ok=True)
        with open(os.path.join(base, name), "w") as f:
            f.write("v1")
        one = rev()
        with open(os.path.join(base, name), "w") as f:
            f.write("v2")
        assert rev() not in (one, first), name


def test_a_directory_without_weights_says_so(tmp_path, caplog, cache):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="kvtier.fingerprint"):
        checkpoint_revision(str(tmp_path / "m"), cache_path=cache)
    assert "no weight file" in caplog.text


def test_an_unresolvable_name_falls_back_to_name_and_revision_with_a_warning(
        tmp_path, monkeypatch, caplog, cache):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtier.fingerprint"):
        assert checkpoint_revision("my-served-model", hub_dir=str(tmp_path),
                                   cache_path=cache) == "main"
        assert checkpoint_revision("org/model", "v1", hub_dir=str(tmp_path),
                                   cache_path=cache) == "v1"
        assert checkpoint_revision("org/model", hub_dir=str(tmp_path), cache_path=cache,
                                   fallback="") == ""
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
    assert weights_revision(w, {"rope_theta": 1e4}) != weights_revision(w, {"rope_theta": 5e5})
    assert weights_revision(w, {"a": 1, "_name_or_path": "/x"}) == weights_revision(w, {"a": 1})
    with pytest.raises(ValueError, match="meta tensor"):
        weights_revision({"a": torch.empty(3, device="meta")})


def test_an_engine_names_weights_that_came_with_no_revision_by_their_fingerprint(tmp_path):
    """Random weights, a model built from a hand-made config, a transformers model converted
    with a name: each kept the revision "main", so two of them of one name shared their
    KV blocks, and one engine was handed the other's KV (other tokens than without the
    store). Now an engine fingerprints weights that came with no revision."""
    from engine_adapter.config import EngineConfig, ModelConfig
    from engine_adapter.engine import LLMEngine
    from engine_adapter.loader import random_model
    from engine_adapter.sampling import SamplingParams
    from kvstore.config import StoreConfig, TierConfig
    from kvstore.store import TieredStore
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                      name="same-name")
    a, b, a_again = random_model(cfg, seed=0), random_model(cfg, seed=1), random_model(cfg, seed=0)
    ec = EngineConfig(num_blocks=64, block_tokens=4, max_num_batched_tokens=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    namespaces = [LLMEngine(m, ec).ns for m in (a, b, a_again)]
    assert namespaces[0] != namespaces[1] and namespaces[0] == namespaces[2]
    alone = LLMEngine(b, ec).generate([prompt], greedy)[0].token_ids
    with TieredStore(namespaces[0], StoreConfig(tiers=(TierConfig("dram", 64),))) as store:
        LLMEngine(a, ec, store=store).generate([prompt], greedy)
        other = LLMEngine(b, ec, store=store).generate([prompt], greedy)[0]
        assert other.num_loaded_tokens == 0 and other.token_ids == alone
        again = LLMEngine(a_again, ec, store=store).generate([prompt], greedy)[0]
        assert again.num_loaded_tokens == 36  # equal weights share, as ever
