"""Shared fixtures. Keep this file small: per-area fixtures live beside their tests."""
import os

# Triton kernels run under the interpreter on CPU-only machines (tiny shapes only).
os.environ.setdefault("TRITON_INTERPRET", "1")
