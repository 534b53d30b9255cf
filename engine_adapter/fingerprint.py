"""Which weights a model runs: the revision part of its KV namespace.

KV blocks are keyed by the model's name and its revision (`kvstore.keys.Namespace`). A name
alone does not say which weights: a checkpoint retrained into the same directory, or a hub
model whose `main` moved on, would be handed the KV the old weights computed. So every
engine names its weights by what they are:

- `weights_revision`: a fingerprint of tensors in memory and the config that runs them (our
  engine, the transformers plugin);
- `checkpoint_revision`: of a checkpoint an engine loads by path or hub id (the vLLM and
  SGLang plugins): a local directory or file by the content of its files (every file but
  the few that cannot change KV, such as tokenizer files and READMEs), hashed once per file
  version and then remembered in a cache keyed by the file's identity, change time and a
  32 KiB sample of its bytes; a hub id by the commit its revision resolves to in the
  engine's hub cache. An engine's settings that change KV without changing files (config
  overrides, quantization, load format) are mixed in by the plugin (`extra`).

Equal weights get equal revisions on any host (the fingerprint is of bytes, not of paths or
times), so a pool shared by many engines still shares their KV.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import tempfile
from typing import Any, Mapping

import xxhash

from kvstore import env

log = logging.getLogger("kvtier.fingerprint")

# files of a checkpoint that cannot change its KV for given token ids (tokenizer files change
# the token ids, which change block hashes already), and a trainer's state beside weights
IGNORED = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "added_tokens.json",
           "chat_template*", "generation_config.json", "*.md", "README*", "LICENSE*", "NOTICE*",
           "USE_POLICY*", "optimizer.*", "scheduler.pt", "rng_state*", "trainer_state.json",
           "training_args.bin", "*.lock", "*.png", "*.jpg")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".h5",
                   ".msgpack", ".tensors", ".onnx")
READ_BYTES = 8 << 20
PROGRESS_BYTES = 1 << 30  # a progress bar for checkpoints at least this big
COMMIT = re.compile(r"[0-9a-f]{40}")
CACHE_VERSION = 2


def weights_revision(weights: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> str:
    """A fingerprint of a model's tensors in memory (names, dtypes, shapes and bytes) and of
    the `config` that runs them (rope, norm epsilon...): two models of one name but other
    weights or settings never share blocks. xxh3_128, ~0.1 s a GB (a GPU tensor is copied to
    the host one at a time). ValueError for tensors that are not here (meta tensors of an
    offloaded model): name the weights yourself then."""
    import torch

    h = xxhash.xxh3_128()
    for key in sorted(weights):
        t = weights[key].detach()
        if t.is_meta:
            raise ValueError(f"cannot fingerprint {key!r}: a meta tensor (weights offloaded "
                             "or not loaded); pass a revision that names these weights")
        t = t.contiguous().cpu()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    if config:
        h.update(b"config|" + canonical(config))
    return "w-" + h.hexdigest()[:32]


def canonical(config: Mapping[str, Any]) -> bytes:
    """A config as stable bytes (its name or path left out: where it was loaded from is not
    what it is)."""
    cfg = {k: v for k, v in config.items() if k not in ("_name_or_path", "name_or_path")}
    return json.dumps(cfg, sort_keys=True, default=str).encode()


def checkpoint_revision(model: str, revision: str | None = None, *, hub_dir: str | None = None,
                        extra: bytes = b"", cache_path: str | None = None,
                        fallback: str | None = None) -> str:
    """The revision of the checkpoint an engine loads as `model` (a local directory or file,
    or a hub id) at `revision` (the engine's, None for the default branch), with the
    engine's own settings that change KV (`extra`: config overrides, quantization...):

    - a local path: "f-" + a fingerprint of its files' content;
    - a hub id whose `revision` is a commit, or resolves to one in the engine's hub cache
      (`hub_dir`, else huggingface_hub's own: $HF_HUB_CACHE, $HF_HOME/hub...): "hf-" +
      the commit;
    - else the name alone: `fallback` if given, else `revision` or "main" (what the plugins
      used before: their blocks stay readable), with a warning (set the plugin's
      `kvtier_revision` to say which weights these are).

    `extra` is added as "+" and its own fingerprint (not to a fallback: that one stays the
    name it always was)."""
    suffix = "+" + xxhash.xxh3_64_hexdigest(extra) if extra else ""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return "f-" + _files_fingerprint(path, cache_path or default_cache_path()) + suffix
    if revision and COMMIT.fullmatch(revision):
        return "hf-" + revision + suffix
    commit = hub_commit(model, revision or "main", hub_dir)
    if commit:
        return "hf-" + commit + suffix
    log.warning("kvtier keys the KV of %r by its name and revision %r alone (no local "
                "checkpoint and no hub commit found for it): other weights served under this "
                "name would share its blocks. Set kvtier_revision to a name for these weights",
                model, revision or "main")
    return (revision or "main") if fallback is None else fallback


def hub_commit(repo_id: str, revision: str, hub_dir: str | None = None) -> str | None:
    """The commit `revision` (a branch or tag) of hub repo `repo_id` resolves to in the hub
    cache the engine downloads into (`hub_dir`, else `hub_cache_root()`), or None. One cache
    only: another one's refs may be stale."""
    if (not repo_id or repo_id.count("/") > 1 or ".." in repo_id or repo_id.startswith("/")
            or ".." in revision or revision.startswith("/")):
        return None  # (not a hub id, or a path out of the cache)
    folder = "models--" + repo_id.replace("/", "--")
    try:
        with open(os.path.join(hub_dir or hub_cache_root(), folder, "refs", revision)) as f:
            commit = f.read().strip()
    except OSError:
        return None
    return commit if COMMIT.fullmatch(commit) else None


def hub_cache_root() -> str:
    """Where huggingface_hub keeps downloads (its own answer when installed, which the
    engines use; else the same rules: $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub,
    $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub)."""
    try:
        from huggingface_hub import constants
        return constants.HF_HUB_CACHE
    except ImportError:
        pass
    expand = lambda p: os.path.expanduser(os.path.expandvars(p))  # noqa: E731
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return expand(os.environ[var])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(expand(home), "hub")


def checkpoint_files(path: str) -> list[str]:
    """The files of a checkpoint whose content names its revision: a file itself, or every
    file under a directory (subdirectories too, hidden ones aside) but those in IGNORED.
    Sorted by their path within the checkpoint."""
    if not os.path.isdir(path):
        return [path]
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.startswith(".") or any(fnmatch.fnmatch(name, p) for p in IGNORED):
                continue
            full = os.path.join(root, name)
            if os.path.isfile(full):  # (a dangling link: not part of it)
                out.append(full)
    return sorted(out, key=lambda f: os.path.relpath(f, path))


def _files_fingerprint(path: str, cache_path: str) -> str:
    files = checkpoint_files(path)
    if os.path.isdir(path) and not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
        log.warning("no weight file in %s: its KV is named by its other files only (weights "
                    "loaded from elsewhere are not seen; set kvtier_revision)", path)
    stats = [(f, os.stat(f)) for f in files]
    h = xxhash.xxh3_128()  # (paths within the checkpoint, sizes and contents)
    base = path if os.path.isdir(path) else os.path.dirname(path)
    for (f, st), digest in zip(stats, _digests(stats, cache_path)):
        name = os.path.relpath(f, base) if os.path.isdir(path) else os.path.basename(f)
        h.update(f"{name}|{st.st_size}|{digest}\n".encode())
    return h.hexdigest()


def _digests(stats: list[tuple[str, os.stat_result]], cache_path: str) -> list[str]:
    """xxh3_128 of each file's content, from the cache where this version of it was hashed.
    One process hashes, the others (a scheduler and its TP workers start together) wait for
    it and read what it found."""
    keys = [_identity(f, st) for f, st in stats]
    cache = _load_cache(cache_path)
    if any(k not in cache for k in keys):
        with _Lock(cache_path + ".lock"):
            cache = _load_cache(cache_path)
            todo = [(f, st, k) for (f, st), k in zip(stats, keys) if k not in cache]
            if todo:
                for (_, _, key), digest in zip(todo, _hash_files(todo)):
                    cache[key] = digest
                _save_cache(cache_path, cache)
    return [cache[k] for k in keys]


def _identity(path: str, st: os.stat_result) -> str:
    """A file version: where it is, when it last changed (ctime: no write leaves it as it
    was, os.utime included) and a sample of its bytes: a filesystem whose times are coarse
    or cached (NFS: a second, or the attribute cache's) can show a file rewritten in place
    at the same size with the times it had, and a retrain changes bytes everywhere."""
    return (f"{os.path.realpath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|"
            f"{st.st_mtime_ns}|{st.st_ctime_ns}|{_sample(path, st.st_size)}")


SAMPLES, SAMPLE_BYTES = 8, 4096  # 32 KiB read a file version, spread over it


def _sample(path: str, size: int) -> str:
    """xxh3_64 of SAMPLES pieces of the file, spread evenly (all of a small file)."""
    h = xxhash.xxh3_64()
    try:
        with open(path, "rb", buffering=0) as f:
            if size <= SAMPLES * SAMPLE_BYTES:
                h.update(f.read())
            else:
                step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
                for i in range(SAMPLES):
                    h.update(os.pread(f.fileno(), SAMPLE_BYTES, i * step))
    except OSError:
        return "unreadable"  # (hashing it says why)
    return h.hexdigest()


def file_digest(path: str, cache_path: str | None = None) -> str:
    """xxh3_128 of one file's content, from the cache when this version of it was hashed."""
    return _digests([(path, os.stat(path))], cache_path or default_cache_path())[0]


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
    return os.path.join(env.cache_root(), "fingerprints.json")


class _Lock:
    """An exclusive flock on `path` for the block (none where it cannot be had: then each
    process hashes for itself, which is slower, never wrong)."""

    def __init__(self, path: str) -> None:
        self.path, self.fd = path, -1

    def __enter__(self) -> "_Lock":
        import fcntl
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            if self.fd >= 0:
                os.close(self.fd)
            self.fd = -1
        return self

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # (releases the lock)


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
    """Written whole and renamed into place. Entries of files gone are dropped. A cache that
    cannot be written is skipped: the next start hashes again."""
    live = {k: v for k, v in cache.items() if os.path.exists(k.split("|", 1)[0])}
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fingerprints-")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "files": live}, f)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.info("kvtier could not keep weight fingerprints in %s (%s): they are computed "
                 "again at the next start", path, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
