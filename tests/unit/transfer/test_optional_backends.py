"""The conformance suite for the optional NIXL / UCX adapters, run whole inside a network
namespace that has loopback alone.

NIXL and UCX listen on every network interface whatever they are asked, so neither is ever
started in the host namespace: each case below launches pytest under `unshare -n` (after
`ip link set lo up`) on test_conformance.py for one backend, and asserts on its outcome. Inside
that namespace conftest sees loopback only and lets those cases run.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from transfer import BackendKind

from .conftest import loopback_only, optional_missing

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
CONFORMANCE = os.path.join(HERE, "test_conformance.py")
RUN_LIMIT_S = 600  # a hung adapter fails the case instead of hanging the suite


def _netns_unavailable() -> str | None:
    if loopback_only():
        return "already inside a loopback-only namespace: test_conformance.py runs these directly"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed: cannot make a loopback-only network namespace"
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`unshare -n` is not permitted here: {probe.stderr.strip()}"
    return None


def run_in_netns(kind: BackendKind) -> subprocess.CompletedProcess:
    pytest_cmd = [sys.executable, "-m", "pytest", "--import-mode=importlib", "-p",
                  "no:cacheprovider", "-q", "-rs", CONFORMANCE, "-k", kind.value]
    script = "ip link set lo up && exec " + " ".join(f"'{a}'" for a in pytest_cmd)
    return subprocess.run(["unshare", "-n", "sh", "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=RUN_LIMIT_S)


@pytest.mark.parametrize("kind", [BackendKind.NIXL, BackendKind.UCX], ids=lambda k: k.value)
def test_conformance_in_loopback_namespace(kind):
    missing = optional_missing(kind)
    if missing:
        pytest.skip(missing)
    why = _netns_unavailable()
    if why:
        pytest.skip(why)
    done = run_in_netns(kind)
    out = done.stdout + done.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert done.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 15, summary
    assert not re.search(r"failed|error|skipped", summary), out[-6000:]
