"""A real etcd server per test module, on loopback, stopped at the end."""
import pytest

from kvstore.cluster.etcdproc import EtcdProcess, etcd_missing


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    why = etcd_missing()
    if why:
        pytest.skip(why)
    with EtcdProcess(str(tmp_path_factory.mktemp("etcd")), name="kvtier-test") as server:
        yield server
