"""Backend choice: KVTIER_KERNELS=ref|triton|auto, decided once at import."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kernels
from kernels import dispatch
from kernels.errors import KernelBackendError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize(
    "requested,cuda,triton_ok,interp,expected",
    [
        ("auto", False, True, True, "ref"),  # auto on CPU: ref, even when interpreting
        ("auto", True, True, False, "triton"),
        ("auto", True, False, False, "ref"),  # no triton installed
        ("", False, True, False, "ref"),
        ("ref", True, True, False, "ref"),
        (" Triton ", True, True, False, "triton"),
        ("triton", False, True, True, "triton"),  # CPU tensors through the interpreter
    ],
)
def test_resolve(requested, cuda, triton_ok, interp, expected):
    assert dispatch.resolve(requested, cuda, triton_ok, interp) == expected


@pytest.mark.parametrize(
    "requested,cuda,triton_ok,interp,words",
    [
        ("triton", False, True, False, "TRITON_INTERPRET=1"),
        ("triton", True, False, False, "not installed"),
        ("cuda", True, True, False, "expected one of"),
    ],
)
def test_resolve_refuses(requested, cuda, triton_ok, interp, words):
    with pytest.raises(KernelBackendError, match=words):
        dispatch.resolve(requested, cuda, triton_ok, interp)


def test_every_backend_has_every_op():
    assert dispatch.load("ref").NAME == "ref"
    pytest.importorskip("triton")
    assert dispatch.load("triton").NAME == "triton"


def test_default_here_is_consistent_with_the_machine():
    import torch

    if os.environ.get(dispatch.ENV_VAR, "auto") == "auto":
        assert kernels.BACKEND == ("triton" if torch.cuda.is_available() else "ref")


def _run(env_extra: dict[str, str], code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.triton_interp
def test_triton_backend_runs_under_the_interpreter_in_a_fresh_process():
    pytest.importorskip("triton")
    code = (
        "import torch, kernels\n"
        "c = kernels.allocate_kv_cache(4, 1, 4, 1, 8, dtype=torch.float32)\n"
        "kernels.write_kv_to_cache(torch.ones(2, 1, 8), torch.ones(2, 1, 8), kernels.layer_view(c, 0), torch.tensor([5, 6]))\n"
        "print(kernels.BACKEND, kernels.paged_decode_attention.__module__, float(c.sum()))\n"
    )
    done = _run({"KVTIER_KERNELS": "triton", "TRITON_INTERPRET": "1"}, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["triton", "kernels.triton.decode", "32.0"]


def test_triton_on_cpu_without_interpreter_fails_at_import():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    done = _run({"KVTIER_KERNELS": "triton", "TRITON_INTERPRET": "0"}, "import kernels")
    assert done.returncode != 0 and "KernelBackendError" in done.stderr and "TRITON_INTERPRET=1" in done.stderr
