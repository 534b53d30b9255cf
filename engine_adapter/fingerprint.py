"""Which weights a model runs: the revision part of its KV namespace.

KV blocks are keyed by the model's name and its revision (`kvstore.keys.Namespace`). A name
alone does not say which weights: a checkpoint retrained into the same directory, or a hub
model whose `main` moved on, would be handed the KV the old weights computed. So every
engine names its weights by what they are:

- `weights_revision`: a fingerprint of tensors in memory (our engine, the transformers plugin);
- `checkpoint_revision`: of a checkpoint an engine loads by path or hub id (the vLLM and
  SGLang plugins): a local directory or file by the content of its config and weight files
  (hashed once per file version, then remembered in a cache keyed by the file's identity and
  change time), a hub id by the commit its revision resolves to in the local hub cache.

Equal weights get equal revisions on any host (the fingerprint is of bytes, not of paths or
times), so a pool shared by many engines still shares their KV.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from typing import Mapping

import xxhash

log = logging.getLogger("kvtier.fingerprint")

# what a checkpoint directory's KV depends on: its config and its weights (not its tokenizer
# files: they change token ids, which change block hashes already)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".h5")
CONFIG_FILES = ("config.json", "params.json")
READ_BYTES = 8 << 20
PROGRESS_BYTES = 1 << 30  # a progress bar for checkpoints at least this big
COMMIT = re.compile(r"[0-9a-f]{40}")
CACHE_VERSION = 1


def weights_revision(weights: Mapping[str, "torch.Tensor"]) -> str:  # noqa: F821
    """A fingerprint of a model's weights in memory (names, dtypes, shapes and bytes):
    two checkpoints with one name never share blocks. xxh3_128, ~0.1 s a GB (a GPU tensor
    is copied to the host one at a time)."""
    import torch

    h = xxhash.xxh3_128()
    for key in sorted(weights):
        t = weights[key].detach().contiguous().cpu()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return "w-" + h.hexdigest()[:32]


def checkpoint_revision(model: str, revision: str | None = None, *,
                        hub_dirs: tuple[str, ...] = (), cache_path: str | None = None,
                        fallback: str | None = None) -> str:
    """The revision of the checkpoint an engine loads as `model` (a local directory or file,
    or a hub id) at `revision` (the engine's, None for the default branch):

    - a local path: "f-" + a fingerprint of its config and weight files' content;
    - a hub id whose `revision` is a commit, or resolves to one in the local hub cache
      (`hub_dirs` first, then $HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub): "hf-" +
      the commit;
    - else the name alone: `fallback` if given, else `revision` or "main" (what the plugins
      used before: their blocks stay readable), with a warning (set the plugin's
      `kvtier_revision` to say which weights these are)."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return "f-" + _files_fingerprint(path, cache_path)
    if revision and COMMIT.fullmatch(revision):
        return "hf-" + revision
    commit = hub_commit(model, revision or "main", hub_dirs)
    if commit:
        return "hf-" + commit
    log.warning("kvtier keys the KV of %r by its name and revision %r alone (no local "
                "checkpoint and no hub commit found for it): other weights served under this "
                "name would share its blocks. Set kvtier_revision to a name for these weights",
                model, revision or "main")
    return (revision or "main") if fallback is None else fallback


def hub_commit(repo_id: str, revision: str, hub_dirs: tuple[str, ...] = ()) -> str | None:
    """The commit `revision` (a branch or tag) of hub repo `repo_id` resolves to in a local
    hub cache (models--org--name/refs/<revision>), or None."""
    if repo_id.count("/") != 1 or ".." in repo_id or ".." in revision or revision.startswith("/"):
        return None  # (not a hub id, or a path out of the cache)
    folder = "models--" + repo_id.replace("/", "--")
    for root in (*hub_dirs, *_hub_roots()):
        try:
            with open(os.path.join(root, folder, "refs", revision)) as f:
                commit = f.read().strip()
        except OSError:
            continue
        if COMMIT.fullmatch(commit):
            return commit
    return None


def _hub_roots() -> list[str]:
    roots = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        roots.append(os.path.join(os.environ["HF_HOME"], "hub"))
    roots.append(os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub"))
    return roots


def checkpoint_files(path: str) -> list[str]:
    """The files of a checkpoint whose content names its revision: a file itself, or a
    directory's config and weight files (its top level, where engines look)."""
    if not os.path.isdir(path):
        return [path]
    names = sorted(n for n in os.listdir(path)
                   if n in CONFIG_FILES or n.endswith(WEIGHT_SUFFIXES))
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]


def _files_fingerprint(path: str, cache_path: str | None) -> str:
    files = [(f, os.stat(f)) for f in checkpoint_files(path)]
    cache_path = cache_path or default_cache_path()
    cache = _load_cache(cache_path)
    keys = [_identity(f, st) for f, st in files]
    todo = [(f, st, key) for (f, st), key in zip(files, keys) if key not in cache]
    if todo:
        for (_, _, key), digest in zip(todo, _hash_files(todo)):
            cache[key] = digest
        _save_cache(cache_path, cache)
    h = xxhash.xxh3_128()  # (names within the checkpoint, sizes and contents: not paths)
    for (f, st), key in zip(files, keys):
        h.update(f"{os.path.basename(f)}|{st.st_size}|{cache[key]}\n".encode())
    return h.hexdigest()


def _identity(path: str, st: os.stat_result) -> str:
    """A file version: where it is and when it last changed (ctime: no write leaves it as it
    was, os.utime included)."""
    return (f"{os.path.realpath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|"
            f"{st.st_mtime_ns}|{st.st_ctime_ns}")


def _hash_files(todo: list) -> list[str]:
    total = sum(st.st_size for _, st, _ in todo)
    bar = None
    if total >= PROGRESS_BYTES:
        from tqdm import tqdm
        log.info("fingerprinting %.1f GiB of weights (once per checkpoint version)", total / 2**30)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="kvtier: weights fingerprint")
    buf = memoryview(bytearray(READ_BYTES))
    out = []
    try:
        for f, _, _ in todo:
            h = xxhash.xxh3_128()
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    h.update(buf[:n])
                    if bar is not None:
                        bar.update(n)
            out.append(h.hexdigest())
    finally:
        if bar is not None:
            bar.close()
    return out


def default_cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "kvtier", "fingerprints.json")


def _load_cache(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") == CACHE_VERSION and isinstance(data.get("files"), dict):
            return {k: v for k, v in data["files"].items()
                    if isinstance(k, str) and isinstance(v, str)}
    except (OSError, ValueError, AttributeError):
        pass  # none yet, unreadable or damaged: hashed again, and written anew
    return {}


def _save_cache(path: str, cache: dict[str, str]) -> None:
    """Written whole and renamed into place (processes fingerprinting at once each write a
    whole file; the last one stays). A cache that cannot be written is skipped: the next
    start hashes again."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fingerprints-")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "files": cache}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.info("kvtier could not keep weight fingerprints in %s (%s): they are computed "
                 "again at the next start", path, e)
