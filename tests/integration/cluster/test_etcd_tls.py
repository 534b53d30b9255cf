"""etcd over TLS: a real etcd serving its clients over TLS only, asking each for a
certificate (--client-cert-auth), and the nodes and pool clients that reach it with
--etcd-ca-file / --etcd-cert-file / --etcd-key-file (etcd_ca_file= ... for a pool client).
Without TLS the pool's records and an etcd user's password crossed the network in the
clear: anyone on the path could read the password, and with it rewrite the membership."""
from __future__ import annotations

import asyncio
import logging
import subprocess

import pytest

import kvstore
from kvstore.client.cluster import ClusterClient
from kvstore.cluster import membership
from kvstore.cluster.etcdproc import EtcdProcess, ServerTls, etcd_missing
from kvstore.cluster.records import ClusterError, EtcdTls, parse_etcd_url, read_etcd_tls
from kvstore.daemon.config import DaemonConfig
from kvstore.errors import ConfigError
from kvstore.store import PutStatus

from ..daemon.conftest import NS, Daemon
from .pki import Pki
from .test_pool import Pool, chain, check_bytes, payload, read, wait_until


def _start(directory, name: str) -> tuple[EtcdProcess, Pki, tuple[str, str]]:
    why = etcd_missing()
    if why:
        pytest.skip(why)
    pki = Pki(directory / "pki")
    server = pki.issue("server", "etcd", server=True)
    client = pki.issue("client", "kvtier-node", server=False)
    etcd = EtcdProcess(str(directory / "etcd"), name=name,
                       tls=ServerTls(*server, pki.ca, *client)).start()
    return etcd, pki, client


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    etcd, pki, client = _start(tmp_path_factory.mktemp("etcd-tls"), "kvtier-tls")
    try:
        yield etcd, pki, client
    finally:
        etcd.stop()


def test_a_pool_forms_and_serves_over_tls(tls_etcd, tmp_path):
    etcd, pki, (cert, key) = tls_etcd
    files = ("--etcd-ca-file", pki.ca, "--etcd-cert-file", cert, "--etcd-key-file", key)
    pool = Pool(etcd, tmp_path / "pool", 2, *files)
    try:
        wait_until(lambda: all(len(pool.view(n).get("members", ())) == 2 for n in pool.nodes),
                   30, "two members, over TLS")
        assert pool.url.startswith("etcd://")  # (TLS from the files; etcds:// says it alone)
        with ClusterClient(pool.url, namespace=NS, etcd_ca_file=pki.ca, etcd_cert_file=cert,
                           etcd_key_file=key) as c:
            hashes = chain(41, 6)
            assert c.put_n(hashes, payload(hashes)) == [PutStatus.STORED] * 6
            out, tiers = read(c, hashes)
            assert check_bytes(hashes, out, tiers) == 6
        tls_url = "etcds://" + pool.url.removeprefix("etcd://")  # (kvstore.connect's too)
        with kvstore.connect(tls_url, namespace=NS, etcd_ca_file=pki.ca, etcd_cert_file=cert,
                             etcd_key_file=key) as c:
            assert isinstance(c, ClusterClient)
            out, tiers = read(c, hashes)
            assert check_bytes(hashes, out, tiers) == 6
        with pytest.raises(ValueError, match="goes to kvstore.connect or ClusterClient"):
            kvstore.Client(tls_url, namespace=NS)
        # a node whose TLS is wrong stays out, and says why
        stranger = Daemon(str(tmp_path / "stranger"), "--cluster", pool.url, "--node-id", "x")
        try:  # (it may answer /healthz a moment before it tries etcd)
            stranger.start(timeout_s=30)
        except RuntimeError:
            pass
        assert stranger.proc.wait(30) != 0
        assert "etcds://" in stranger.output(), stranger.output()
        stranger.close()
        assert len(pool.view("n0").get("members", ())) == 2
    finally:
        pool.stop()


def test_wrong_or_missing_tls_is_refused_with_what_to_check(tls_etcd, tmp_path):
    etcd, pki, (cert, key) = tls_etcd
    url = etcd.url("kvtier-test-tls-refused")
    other = Pki(tmp_path / "other", name="not-etcds-ca")
    with pytest.raises(ClusterError, match="If etcd serves TLS.*etcds://"):
        ClusterClient(url, namespace=NS)  # plain gRPC to a TLS port
    with pytest.raises(ClusterError, match="Over TLS: is the CA"):
        ClusterClient(url, namespace=NS, etcd_ca_file=other.ca, etcd_cert_file=cert,
                      etcd_key_file=key)  # etcd's certificate does not chain to this CA
    with pytest.raises(ClusterError, match="Over TLS"):
        ClusterClient(url, namespace=NS, etcd_ca_file=pki.ca)  # etcd asks for a client's
    stranger_cert, stranger_key = other.issue("client", "stranger", server=False)
    with pytest.raises(ClusterError, match="Over TLS"):  # a client certificate etcd's CA
        ClusterClient(url, namespace=NS, etcd_ca_file=pki.ca,  # did not sign
                      etcd_cert_file=stranger_cert, etcd_key_file=stranger_key)


def test_an_etcd_login_over_tls(tmp_path):
    """Users and TLS together: the password goes inside TLS (the login is this client's,
    aetcd's own opens plain channels only); a wrong one is refused as without TLS."""
    etcd, pki, (cert, key) = _start(tmp_path, "kvtier-tls-auth")
    try:
        def ctl(*args: str) -> None:
            subprocess.run(["etcdctl", "--endpoints", f"https://{etcd.endpoint}", "--cacert",
                            pki.ca, "--cert", cert, "--key", key, *args], check=True,
                           capture_output=True, timeout=30)
        ctl("user", "add", "root", "--new-user-password=rootpw")
        ctl("role", "add", "pool")
        ctl("role", "grant-permission", "pool", "readwrite", "/tls-auth", "--prefix=true")
        ctl("user", "add", "node", "--new-user-password=nodepw")
        ctl("user", "grant-role", "node", "pool")
        ctl("auth", "enable")
        tls = read_etcd_tls(pki.ca, cert, key)
        for password, works in (("nodepw", True), ("nope", False)):
            creds = tmp_path / f"creds-{password}"
            creds.write_text(f"node:{password}\n")
            creds.chmod(0o600)
            address = parse_etcd_url(etcd.url("tls-auth"), str(creds), tls)

            async def roundtrip() -> bytes:
                client = await membership.connect(address)
                try:
                    await client.put(b"/tls-auth/k", b"v")
                    return (await client.get(b"/tls-auth/k")).value
                finally:
                    await client.close()
            if works:
                assert asyncio.run(roundtrip()) == b"v"
            else:
                with pytest.raises(ClusterError, match="refused user 'node'"):
                    asyncio.run(roundtrip())
    finally:
        etcd.stop()


def test_tls_files_are_checked_before_anything_starts(tmp_path):
    pki = Pki(tmp_path / "pki")
    cert, key = pki.issue("client", "kvtier-node", server=False)
    tls = read_etcd_tls(pki.ca, cert, key)
    assert tls.ca.startswith(b"-----BEGIN CERTIFICATE") and tls.key is not None
    assert "PRIVATE" not in repr(parse_etcd_url("etcd://h:1/x", tls=tls))  # (never the key)
    assert read_etcd_tls() is None
    assert parse_etcd_url("etcds://h:1/x").tls == EtcdTls()  # the system's roots
    assert parse_etcd_url("etcd://h:1/x").tls is None
    with pytest.raises(ConfigError, match="both --etcd-cert-file and --etcd-key-file"):
        read_etcd_tls(pki.ca, cert, None)
    with pytest.raises(ConfigError, match="holds no PEM CERTIFICATE"):
        read_etcd_tls(key)  # a key where the CA goes
    with pytest.raises(ConfigError, match="cannot read etcd CA file"):
        read_etcd_tls(str(tmp_path / "absent.pem"))
    loose = tmp_path / "loose-key.pem"
    loose.write_bytes(open(key, "rb").read())
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_etcd_tls(pki.ca, cert, str(loose))
    with pytest.raises(ConfigError, match="chmod 600"):
        ClusterClient("etcd://127.0.0.1:1/x", namespace=NS, etcd_ca_file=pki.ca,
                      etcd_cert_file=cert, etcd_key_file=str(loose))
    with pytest.raises(ConfigError, match="--etcd-ca-file is etcd's: it goes with --cluster"):
        DaemonConfig(etcd_ca_file=pki.ca)
    with pytest.raises(ConfigError, match="chmod 600"):
        DaemonConfig(cluster="etcds://127.0.0.1:1/x", etcd_cert_file=cert,
                     etcd_key_file=str(loose))
    assert DaemonConfig(cluster="etcds://127.0.0.1:1/x", etcd_ca_file=pki.ca) \
        .etcd_address().tls == EtcdTls(tls.ca)
    daemon = Daemon(str(tmp_path / "d"), "--cluster", "etcd://127.0.0.1:1/x",
                    "--etcd-key-file", str(loose), "--etcd-cert-file", cert)
    with pytest.raises(RuntimeError, match="chmod 600"):  # (before it opens a port)
        daemon.start(timeout_s=30)
    daemon.close()


def test_a_password_sent_in_the_clear_off_this_host_is_warned_of(tmp_path, caplog, monkeypatch):
    creds = tmp_path / "creds"
    creds.write_text("node:nodepw\n")
    creds.chmod(0o600)
    monkeypatch.setattr(membership, "_CLEAR_CREDENTIALS", membership.LogEvery(3600.0))
    with caplog.at_level(logging.WARNING, logger="kvtier.cluster"):
        # (clients made, never connected: nothing is sent to these documentation addresses)
        membership.etcd_client(parse_etcd_url("etcd://127.0.0.1:2379/x", str(creds)), 0, 1.0)
        assert "in the clear" not in caplog.text  # (this host: nothing crosses a network)
        pki = Pki(tmp_path / "pki")
        membership.etcd_client(parse_etcd_url("etcd://192.0.2.1:2379/x", str(creds),
                                              read_etcd_tls(pki.ca)), 0, 1.0)
        assert "in the clear" not in caplog.text  # (TLS)
        membership.etcd_client(parse_etcd_url("etcd://192.0.2.1:2379/x", str(creds)), 0, 1.0)
        assert "the password of etcd user 'node' goes to 192.0.2.1:2379 in the clear" in caplog.text
