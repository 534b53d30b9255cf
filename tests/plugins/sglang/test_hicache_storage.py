"""kvtier's SGLang HiCache backend against SGLang 0.5.23's own pieces on CPU: its real MHA device
pool and host KV pool, its `StorageBackendFactory` ("dynamic") and the cache controller's own
page-transfer methods (generic and direct). Runs in build/venv-sglang: `make test-sglang`."""
from __future__ import annotations

import importlib.util
import os

import pytest

sglang = pytest.importorskip("sglang", reason="runs in build/venv-sglang (make test-sglang)")
import torch  # noqa: E402

from engine_adapter.plugins.sglang import KVTierHiCacheStorage  # noqa: E402
from engine_adapter.plugins.sglang.storage import key_seed, page_hashes, shard_of  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "sglang_pages", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_pages.py"))
pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pages)
PAGE, LAYERS, HEADS, DIM, LAYOUTS = pages.PAGE, pages.LAYERS, pages.HEADS, pages.DIM, pages.LAYOUTS
make_host_pool, create_backend, pages_kv = pages.make_host_pool, pages.create_backend, pages.pages_kv
ctl_set, ctl_get = pages.ctl_set, pages.ctl_get


def storage_config(tmp_path, model="test/model", tp_rank=0, **options):
    return pages.storage_config(model, tp_rank, kvtier_path=str(tmp_path / "kvtier"), **options)


def sglang_keys(num_pages: int, first_token: int = 0) -> list[str]:
    return pages.sglang_keys(list(range(first_token, first_token + num_pages * PAGE)))


@pytest.fixture
def backends():
    made = []

    def make(config, host_pool):
        made.append(create_backend(config, host_pool))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


# ---------------------------------------------------------------- tests

def test_factory_loads_the_dynamic_backend(tmp_path, backends):
    pool = make_host_pool("layer_first")
    backend = backends(storage_config(tmp_path), pool)
    assert isinstance(backend, KVTierHiCacheStorage)
    assert backend.ns.block_bytes == 2 * LAYERS * PAGE * HEADS * DIM * 2   # one fp16 page
    assert backend.ns.block_tokens == PAGE and backend.ns.model == "test/model"


def test_factory_rejects_a_config_without_a_store(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_URL", raising=False)
    monkeypatch.delenv("KVTIER_PATH", raising=False)
    config = storage_config(tmp_path)
    del config.extra_config["kvtier_path"]
    with pytest.raises(ValueError, match="kvtier needs a store"):
        create_backend(config, make_host_pool("layer_first"))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "generic"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_through_sglangs_transfer_methods(tmp_path, backends, layout, direct):
    pool = make_host_pool(layout)
    backend = backends(storage_config(tmp_path), pool)
    keys, src = sglang_keys(5), pool.alloc(5 * PAGE)
    assert backend.batch_exists(keys) == 0
    assert ctl_set(backend, pool, keys, src, direct)
    assert backend.batch_exists(keys) == 5 and all(backend.exists(k) for k in keys)
    dst = pool.alloc(5 * PAGE)
    expected = pages_kv(pool, src).clone()
    assert not torch.equal(pages_kv(pool, dst), expected)
    assert ctl_get(backend, pool, keys, dst, direct) == 5
    assert torch.equal(pages_kv(pool, dst), expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stored_block_is_kvtiers_layout(tmp_path, backends, layout):
    """[L, 2, T, H, D] per page, whatever the host layout."""
    pool = make_host_pool(layout)
    backend = backends(storage_config(tmp_path), pool)
    keys, idx = sglang_keys(3), pool.alloc(3 * PAGE)
    assert backend.batch_set_v1(keys, idx) == [True] * 3
    blocks = torch.empty((3, *backend.ns.block_shape), dtype=torch.float16)
    assert all(backend.store.get_n(page_hashes(backend.seed, keys), blocks))
    want = pages_kv(pool, idx).view(3, PAGE, 2, LAYERS, HEADS, DIM).permute(0, 3, 2, 1, 4, 5)
    assert torch.equal(blocks, want)


def test_pages_move_across_host_layouts_and_paths(tmp_path, backends):
    writer_pool, reader_pool = make_host_pool("page_first", seed=1), make_host_pool("page_head", seed=2)
    writer = backends(storage_config(tmp_path), writer_pool)
    keys, src = sglang_keys(4), writer_pool.alloc(4 * PAGE)
    assert ctl_set(writer, writer_pool, keys, src, direct=False)
    writer.close()
    reader = backends(storage_config(tmp_path), reader_pool)
    dst = reader_pool.alloc(4 * PAGE)
    assert ctl_get(reader, reader_pool, keys, dst, direct=True) == 4
    assert torch.equal(pages_kv(reader_pool, dst), pages_kv(writer_pool, src))


def test_a_missing_page_ends_the_hit_and_is_left_untouched(tmp_path, backends):
    pool = make_host_pool("layer_first")
    backend = backends(storage_config(tmp_path), pool)
    keys, idx = sglang_keys(4), pool.alloc(4 * PAGE)
    assert backend.batch_set_v1([keys[0], keys[1], keys[3]], torch.cat([idx[:8], idx[12:]])) == [True] * 3
    assert backend.batch_exists(keys) == 2 and not backend.exists(keys[2])
    dst = pool.alloc(4 * PAGE)
    before = pages_kv(pool, dst[8:12]).clone()
    assert backend.batch_get_v1(keys, dst) == [True, True, False, True]
    assert torch.equal(pages_kv(pool, dst[8:12]), before)
    assert torch.equal(pages_kv(pool, dst[12:]), pages_kv(pool, idx[12:]))
    assert ctl_get(backend, pool, keys, pool.alloc(4 * PAGE), direct=False) == 2
    assert backend.get(keys[2]) is None and backend.batch_get(keys)[2] is None


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "generic"])
def test_a_store_that_cannot_answer_is_an_empty_one(tmp_path, backends, direct):
    """Every call raised the store's error into SGLang's cache controller (a daemon gone,
    hung, or a store closed): now lookups find nothing, sets store nothing and gets miss,
    and SGLang computes."""
    pool = make_host_pool("layer_first")
    backend = backends(storage_config(tmp_path), pool)
    keys, src = sglang_keys(3), pool.alloc(3 * PAGE)
    assert ctl_set(backend, pool, keys, src, direct)
    backend.store.close()
    assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])
    assert backend.batch_set_v1(keys, src) == [False] * 3
    assert backend.batch_get_v1(keys, pool.alloc(3 * PAGE)) == [False] * 3
    assert backend.batch_get(keys) == [None] * 3 and backend.get(keys[0]) is None
    assert ctl_get(backend, pool, keys, pool.alloc(3 * PAGE), direct) == 0


def test_pages_survive_a_restart_and_stay_in_their_namespace(tmp_path, backends):
    pool = make_host_pool("page_first")
    first = backends(storage_config(tmp_path, kvtier_dram_blocks=0), pool)
    keys = sglang_keys(3)
    assert first.batch_set_v1(keys, pool.alloc(3 * PAGE)) == [True] * 3
    first.close()
    again = backends(storage_config(tmp_path, kvtier_dram_blocks=0), pool)
    assert again.batch_exists(keys) == 3
    other_rank = backends(storage_config(tmp_path, tp_rank=1, kvtier_dram_blocks=0), pool)
    other_model = backends(storage_config(tmp_path, model="other/model", kvtier_dram_blocks=0), pool)
    assert other_rank.batch_exists(keys) == 0 and other_model.batch_exists(keys) == 0


def test_checkpoints_of_one_path_share_pages_only_when_their_weights_are_equal(tmp_path, backends):
    """SGLang names its storage by the model path: a checkpoint retrained into that path
    must not be handed the old weights' pages; an equal copy elsewhere shares them, and
    kvtier_revision vouches instead of the files."""
    def checkpoint(path, weights: bytes):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text('{"hidden_size": 64}')
        (path / "model.safetensors").write_bytes(weights)
        return str(path)
    pool = make_host_pool("page_first")
    keys = sglang_keys(2)
    ckpt = checkpoint(tmp_path / "final", b"old" * 1000)
    old = backends(storage_config(tmp_path, model=ckpt, kvtier_dram_blocks=0), pool)
    assert old.batch_set_v1(keys, pool.alloc(2 * PAGE)) == [True] * 2
    old.close()
    checkpoint(tmp_path / "final", b"new" * 1000)
    retrained = backends(storage_config(tmp_path, model=ckpt, kvtier_dram_blocks=0), pool)
    assert retrained.batch_exists(keys) == 0
    retrained.close()
    # (SGLang's storage is per model name: the copy is served under the same path)
    checkpoint(tmp_path / "final", b"old" * 1000)
    back = backends(storage_config(tmp_path, model=ckpt, kvtier_dram_blocks=0), pool)
    assert back.batch_exists(keys) == 2
    back.close()
    named = [backends(storage_config(tmp_path, model=ckpt, kvtier_dram_blocks=0,
                                     kvtier_revision="v7"), pool)]
    assert named[0].batch_exists(keys) == 0 and named[0].ns.revision == "sglang-hicache:v7"


KEY_VECTOR = "4f8d42b9104a1f5809891a2158baaed2"  # xxh3_128(recipe || root || shard || key)


def test_page_key_recipe_is_fixed(tmp_path, backends):
    """Keys must agree across processes and releases: a test vector of the recipe."""
    backend = backends(storage_config(tmp_path), make_host_pool("layer_first"))
    assert shard_of(backend.config) == "tp0/2:pp0/1:cp0/1"
    seed = key_seed(backend.ns, shard_of(backend.config))
    assert page_hashes(seed, ["00ff"])[0].hex() == KEY_VECTOR
