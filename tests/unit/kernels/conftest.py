"""Kernel-test fixtures: the device the Triton kernels run on here."""
import os
import sys

import pytest
import torch

# The tests import their helpers as `kernels_testlib` under either pytest import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "triton_interp: Triton kernels (interpreter on CPU: tiny shapes only)")


@pytest.fixture(scope="session")
def triton_device() -> str:
    """CUDA when the kernels are compiled for a GPU; the CPU under TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from kernels.triton.common import INTERPRETING

    if torch.cuda.is_available() and not INTERPRETING:
        return "cuda"
    if INTERPRETING:
        return "cpu"
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set")
