"""Daemon configuration: the loopback rule, token files, tenants, the TOML file."""
from __future__ import annotations

import re

import pytest

from kvstore.daemon.config import ADMIN, DaemonConfig, read_token_file, read_toml
from kvstore.errors import ConfigError


def test_non_loopback_bind_needs_a_token():
    with pytest.raises(ConfigError, match="token"):
        DaemonConfig(host="0.0.0.0")
    assert DaemonConfig(host="0.0.0.0", tokens=(("s", ADMIN),)).auth_required
    assert not DaemonConfig(host="::1").auth_required


def test_token_file_and_tenant_grants(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("# comment\nadmin-token\nalice-token alice  # alice only\n")
    cfg = DaemonConfig(tokens=read_token_file(str(f)))
    assert cfg.tenant_of("admin-token") == ADMIN
    assert cfg.tenant_of("alice-token") == "alice"
    assert cfg.tenant_of("nope") is None and cfg.tenant_of("") is None
    assert DaemonConfig().tenant_of("") == ADMIN  # no tokens configured: loopback, open
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="no token"):
        read_token_file(str(tmp_path / "empty"))
    (tmp_path / "star").write_text(f"sneaky {ADMIN}\n")  # a tenant named like the admin mark
    with pytest.raises(ConfigError, match="not a tenant name"):
        read_token_file(str(tmp_path / "star"))


def test_a_hash_inside_a_token_is_part_of_it_and_a_token_names_one_grant(tmp_path, caplog):
    """`#` began a comment anywhere: `Xy7#kP2q-alice alice` was read as the admin token
    `Xy7`. And a token named twice took the last line's grant."""
    f = tmp_path / "tokens"
    f.write_text("Xy7#kP2q-alice alice #alice's\n#admin\nadm#in-token\n")
    f.chmod(0o600)
    cfg = DaemonConfig(tokens=read_token_file(str(f)))
    assert cfg.tenant_of("Xy7#kP2q-alice") == "alice" and cfg.tenant_of("adm#in-token") == ADMIN
    assert cfg.tenant_of("Xy7") is None and cfg.tenant_of("adm") is None
    assert cfg.tenant_of("\udcff\udcfe") is None  # undecodable header bytes: a bad token
    f.write_text("same alice\nsame\n")
    with pytest.raises(ConfigError, match="twice"):
        read_token_file(str(f))
    f.write_text("tok\n")
    f.chmod(0o644)
    read_token_file(str(f))
    assert "chmod 600" in caplog.text


def test_toml(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[serve]\nport = 9000\ndram_bytes = "2GiB"\n[quotas]\nalice = 10\n')
    kw = read_toml(str(f))
    assert kw["port"] == 9000 and kw["tenant_quotas"] == (("alice", 10),)
    f.write_text("[serve]\nbogus = 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        read_toml(str(f))
    assert DaemonConfig(quota_blocks=5, tenant_quotas=(("a", 2),)).quota_for("a") == 2


@pytest.mark.parametrize("kw", [
    dict(idle_timeout_s=float("inf")), dict(hello_timeout_s=float("nan")),
    dict(high_watermark=2.0), dict(low_watermark=0.99, high_watermark=0.5),
    dict(durable="no"), dict(dram_bytes=True), dict(max_payload_bytes="1GiB"),
    dict(max_connections=1.5), dict(cluster_ttl_s=-1), dict(spin_us=-5),
    dict(block_tokens=-16), dict(quota_blocks=-3), dict(log_level="bogus"),
    dict(node_id=5), dict(data_dir=5), dict(host=None), dict(advertise=7), dict(cluster=1)])
def test_a_value_of_the_wrong_kind_or_range_is_refused_at_start(kw):
    """Each of these started a daemon that then failed every connection (inf, NaN: an
    OverflowError, a ValueError), refused every HELLO, or silently meant something else
    ('no' was true, True was 1 byte, '1GiB' stayed a string)."""
    with pytest.raises(ConfigError):
        DaemonConfig(**kw)


def test_the_config_file_names_what_is_wrong(tmp_path):
    f = tmp_path / "c.toml"
    for text, says in (('[tenant.x]\nmemory = "1GiB"\n', "unknown tables"),
                       ("[quotas]\na = 'many'\n", "many"),
                       ("serve = 5\n", "[serve] table"),
                       ("[serve]\ntoken_file = 0\n", "token_file")):
        f.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(says)):
            read_toml(str(f))
    f.write_text('[serve]\nmax_payload_bytes = "1GiB"\n')
    assert read_toml(str(f))["max_payload_bytes"] == 1 << 30


def test_a_port_in_use_is_a_one_line_error(tmp_path):
    import socket
    import subprocess
    import sys
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--port", "0",
                            "--http-port", str(port), "--data-dir", str(tmp_path / "d"),
                            "--ssd-size", "0", "--dram-size", "16MiB"],
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "pick another --port" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_a_dram_tier_bigger_than_the_memory_there_is_is_refused_at_start():
    """It started, then failed every HELLO ('Python int too large to convert to C long') or
    was killed by the OOM killer when the first namespace's arena was faulted in."""
    from kvstore.daemon.serve import check_memory, memory_limit
    check_memory(DaemonConfig(dram_bytes=1 << 30), 4 << 30)
    check_memory(DaemonConfig(dram_bytes=1 << 50), None)  # (nothing known: nothing refused)
    with pytest.raises(ConfigError, match="--dram-size .* more than"):
        check_memory(DaemonConfig(dram_bytes=2 << 30), 1 << 30)
    limit = memory_limit()
    assert limit is None or limit > 0
    if limit is not None:
        with pytest.raises(ConfigError, match="--dram-size"):
            check_memory(DaemonConfig(dram_bytes=(1 << 50) * 1024), limit)


def test_cluster_settings_a_pool_could_not_use_are_refused():
    """--advertise with a port had joined as "[127.0.0.1:5555]:7481", an address every
    pool client raised on; a pool whose token file names tenants only had started with
    an index no node could report to (the leader answered each report 401)."""
    for bad in ("127.0.0.1:5555", "http://h", "h/x", "a b"):
        with pytest.raises(ConfigError, match="--advertise"):
            DaemonConfig(advertise=bad)
    for good in ("10.1.2.3", "::1", "node-7.example"):
        assert DaemonConfig(advertise=good).advertise == good
    with pytest.raises(ConfigError, match="admin token"):
        DaemonConfig(cluster="etcd://127.0.0.1:2379/p", tokens=(("t", "alice"),))
    assert DaemonConfig(cluster="etcd://127.0.0.1:2379/p",
                        tokens=(("t", "alice"), ("a", ADMIN))).cluster_token == "a"
