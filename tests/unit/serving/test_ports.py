"""The port handshake between the launcher and its workers (`serving.ports`)."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from engine_adapter.serving.ports import bind, wait_port_file, write_port_file


def test_bind_takes_a_kernel_port_and_refuses_connections_until_listening():
    with bind("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        sock.listen()
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_bind_to_a_taken_port_raises():
    with bind("127.0.0.1", 0) as sock:
        sock.listen()
        with pytest.raises(OSError):
            bind("127.0.0.1", sock.getsockname()[1])


def test_the_child_reports_its_port_through_the_file(tmp_path):
    path = str(tmp_path / "w.port")
    code = ("import os, sys, time; p = sys.argv[1]; open(p + '.tmp', 'w').write('4321'); "
            "os.replace(p + '.tmp', p); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, path])
    try:
        assert wait_port_file(path, proc, "child") == 4321
    finally:
        proc.kill()
        proc.wait()


def test_a_child_that_exits_first_is_an_error(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="child exited with code 3 before binding"):
        wait_port_file(str(tmp_path / "never"), proc, "child")


def test_a_stale_file_is_replaced_whole(tmp_path):
    path = str(tmp_path / "w.port")
    write_port_file(path, 1111)
    write_port_file(path, 2222)
    with open(path) as f:
        assert f.read() == "2222\n"
    assert [p.name for p in tmp_path.iterdir()] == ["w.port"]  # no temporary file left
