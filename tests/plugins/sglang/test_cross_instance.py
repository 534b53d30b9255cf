"""Two SGLang processes share pages through one `kvtier serve` and kvtier's HiCache backend.

The first (a child, daemon token from $KVTIER_TOKEN) writes the pages of a prompt from its
`page_first` host pool; this process (token in the backend's extra config, a `page_head`
pool) finds the prompt's shared pages with SGLang's own keys, loads them through the
controller's direct path and gets exactly the KV the first one computed. SGLang's forward
pass does not run on this CPU-only machine (no sgl-kernel): both sides are SGLang's real
storage machinery, driven as its cache controller drives it."""
import importlib.util
import os

import pytest

sglang = pytest.importorskip("sglang", reason="runs in build/venv-sglang (make test-sglang)")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("sglang_pages", os.path.join(HERE, "sglang_pages.py"))
pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pages)


@pytest.mark.timeout(300)
def test_a_second_process_loads_the_pages_the_first_computed(kvtier_daemon, run_instance, monkeypatch):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 30000, (6 * pages.PAGE,), generator=g).tolist()
    first = shared + torch.randint(1, 30000, (3 * pages.PAGE,), generator=g).tolist()
    second = shared + torch.randint(1, 30000, (2 * pages.PAGE,), generator=g).tolist()
    child = run_instance(os.path.join(HERE, "instance.py"),
                         {"tokens": first, "layout": "page_first", "url": kvtier_daemon.url},
                         env={"KVTIER_TOKEN": kvtier_daemon.token})
    assert child == {"stored": True, "pages": 9}

    monkeypatch.delenv("KVTIER_TOKEN", raising=False)
    pool = pages.make_host_pool("page_head", seed=2)
    backend = pages.create_backend(
        pages.storage_config(kvtier_url=kvtier_daemon.url, kvtier_token=kvtier_daemon.token), pool)
    try:
        keys = pages.sglang_keys(second)
        assert backend.batch_exists(keys) == 6            # the shared pages, not the rest
        dst = pool.alloc(6 * pages.PAGE)
        assert not torch.equal(pages.pages_kv(pool, dst), pages.computed_kv(shared))
        assert pages.ctl_get(backend, pool, keys[:6], dst, direct=True) == 6
        assert torch.equal(pages.pages_kv(pool, dst), pages.computed_kv(shared))
    finally:
        backend.close()


def test_the_backend_refuses_a_wrong_token(kvtier_daemon, monkeypatch):
    monkeypatch.delenv("KVTIER_TOKEN", raising=False)
    pool = pages.make_host_pool("layer_first")
    with pytest.raises(Exception, match="bad or missing token"):
        pages.create_backend(pages.storage_config(kvtier_url=kvtier_daemon.url, kvtier_token="wrong"), pool)
