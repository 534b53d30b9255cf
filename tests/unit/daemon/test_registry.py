"""The daemon's namespace registry: its data dir held for its life, and a clear that a
HELLO arriving meanwhile cannot undo."""
import threading

import pytest

from kvstore.daemon import namespaces
from kvstore.daemon.config import ADMIN, DaemonConfig
from kvstore.daemon.namespaces import Registry
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.wire import ErrorCode, RemoteError

NS = Namespace("registry", num_layers=1, num_kv_heads=1, head_dim=64)


def config(tmp_path) -> DaemonConfig:
    return DaemonConfig(data_dir=str(tmp_path / "data"), dram_bytes=1 << 20, ssd_bytes=4 << 20)


def test_a_data_dir_is_served_by_one_registry_at_a_time(tmp_path):
    first = Registry(config(tmp_path))
    with pytest.raises(ConfigError, match="another kvtier serve"):
        Registry(config(tmp_path))
    first.close()
    Registry(config(tmp_path)).close()  # free again once the first closed


def test_a_hello_during_a_clear_waits_for_the_files_to_be_gone(tmp_path, monkeypatch):
    """clear deletes the namespace's files after letting go of the registry's lock: a HELLO
    then created a store on files being deleted (every put answered INTERNAL after). Until
    the delete is done, opening that namespace is UNAVAILABLE (retry); then it opens anew."""
    reg = Registry(config(tmp_path))
    try:
        hosted = reg.open(NS, ADMIN)
        deleting, release = threading.Event(), threading.Event()
        real = namespaces.shutil.rmtree

        def slow_rmtree(path, **kw):
            deleting.set()
            release.wait(10)
            real(path, **kw)
        monkeypatch.setattr(namespaces.shutil, "rmtree", slow_rmtree)
        clearing = threading.Thread(target=reg.clear, args=(hosted,))
        clearing.start()
        assert deleting.wait(10)
        with pytest.raises(RemoteError) as e:
            reg.open(NS, ADMIN)
        assert e.value.code is ErrorCode.UNAVAILABLE and "being cleared" in str(e.value)
        release.set()
        clearing.join(10)
        fresh = reg.open(NS, ADMIN)
        assert fresh is not hosted and fresh.store.contains_n([b"x" * 16]) == [False]
    finally:
        reg.close()


def test_a_namespace_whose_id_collides_with_another_tenants_is_refused(tmp_path, monkeypatch):
    """Stores are found by a 64-bit id: a namespace crafted to share another's id (bob's
    here) must not be handed that namespace's store, whose tenant it was never checked
    against."""
    from kvstore.keys import Namespace as Ns
    bob = Namespace("shared", num_layers=1, num_kv_heads=1, head_dim=64, tenant="bob")
    mallory = Namespace("crafted", num_layers=1, num_kv_heads=1, head_dim=64, tenant="mallory")
    monkeypatch.setattr(Ns, "ns_id", property(lambda self: 0x5EED))
    reg = Registry(config(tmp_path))
    try:
        hosted = reg.open(bob, "bob")
        with pytest.raises(RemoteError) as e:
            reg.open(mallory, "mallory")
        assert e.value.code is ErrorCode.NAMESPACE and "taken by another" in str(e.value)
        assert reg.open(bob, "bob") is hosted
    finally:
        reg.close()
