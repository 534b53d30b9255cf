"""Shared by the engine-plugin tests: one real `kvtier serve` per test module that engine
instances in several processes share, and a way to run an engine instance as a child.

The daemon runs in the project's own environment (`.venv`, made by `make test`; override
with $KVTIER_DAEMON_PYTHON): an engine's virtualenv holds only kvtier's client side. It
binds loopback on free ports, requires a token, and is stopped at the end of the module.
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


daemon_helpers = _load("daemon_conftest", os.path.join(ROOT, "tests", "integration", "daemon", "conftest.py"))


def daemon_python() -> str:
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    return os.environ.get("KVTIER_DAEMON_PYTHON") or (venv if os.path.exists(venv) else sys.executable)


@pytest.fixture(scope="module")
def kvtier_daemon(tmp_path_factory):
    """A token-protected daemon (DRAM tier only); `.url` and `.token`."""
    workdir = tmp_path_factory.mktemp("kvtier-daemon")
    token = secrets.token_hex(16)
    (workdir / "tokens").write_text(token + "\n")
    d = daemon_helpers.Daemon(str(workdir / "data"), "--token-file", str(workdir / "tokens"),
                              "--dram-size", "256MiB", "--ssd-size", "0")
    d.python = daemon_python()
    d.token = token
    d.start(timeout_s=60)
    try:
        yield d
    finally:
        died = d.proc.poll()
        d.close()
        if died is not None:   # it should have lived through the module: say how it ended
            pytest.fail(f"kvtier serve exited during the module with code {died}:\n"
                        f"{d.output()[-3000:]}")


@pytest.fixture(scope="session")
def run_instance():
    """`run_instance(script, args, env)`: see `_run_instance`."""
    return _run_instance


def _run_instance(script: str, args: dict, env: dict | None = None, timeout_s: float = 600) -> dict:
    """Run an engine instance (`python SCRIPT JSON-ARGS`) in a child process with this
    interpreter; it prints one line `RESULT {json}`, returned here."""
    child_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    proc = subprocess.run([sys.executable, script, json.dumps(args)], cwd=ROOT, env=child_env,
                          capture_output=True, text=True, timeout=timeout_s)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise AssertionError(f"{os.path.basename(script)} failed (rc {proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])
