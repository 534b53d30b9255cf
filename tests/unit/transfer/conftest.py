"""Fixtures for the transfer conformance suite: a pair of agents per backend."""
from __future__ import annotations

import importlib.util
import socket
from typing import NamedTuple

import numpy as np
import pytest

from transfer import Agent, AgentConfig, BackendKind, ShmSegment

REGION_BYTES = 4 << 20


OPTIONAL_MODULES = {BackendKind.NIXL: ("nixl", "nixl_cu12", "nixl_cu13"),
                    BackendKind.UCX: ("ucxx",)}


def loopback_only() -> bool:
    """True inside a network namespace whose only interface is loopback (`unshare -n`)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def optional_missing(kind: BackendKind) -> str | None:
    """Why the optional adapter `kind` cannot be imported here, or None."""
    modules = OPTIONAL_MODULES.get(kind, ())
    if modules and not any(importlib.util.find_spec(m) for m in modules):
        return f"{kind.value}: python package {' / '.join(modules)} is not installed"
    return None


def _available(kind: BackendKind) -> str | None:
    """None when `kind` can run here, else why it is skipped.

    NIXL and UCX listen on every network interface whatever they are asked, so their cases run
    only inside a loopback-only namespace; test_optional_backends.py runs them there."""
    if kind not in OPTIONAL_MODULES:
        return None
    missing = optional_missing(kind)
    if missing:
        return missing
    if not loopback_only():
        return (f"{kind.value}: listens on every interface; runs only inside `unshare -n` "
                "(see test_optional_backends.py)")
    return None


BACKENDS = [pytest.param(k, marks=pytest.mark.skipif(_available(k) is not None,
                                                     reason=str(_available(k))), id=k.value)
            for k in BackendKind]


class Pair(NamedTuple):
    kind: BackendKind
    a: Agent  # initiator
    b: Agent  # target, exports `seg`
    seg: ShmSegment
    src: np.ndarray  # registered on a
    local_region: object
    remote_region: object


def make_config(kind: BackendKind, **kw) -> AgentConfig:
    # shm notifications ride on tcp, so the shm pair keeps tcp as the control path
    backends = (kind, BackendKind.TCP) if kind is BackendKind.SHM else (kind,)
    return AgentConfig(backends=backends, io_timeout_s=kw.pop("io_timeout_s", 2.0),
                       connect_timeout_s=2.0, **kw)


@pytest.fixture(params=BACKENDS)
def pair(request):
    kind = request.param
    a = Agent("a", make_config(kind))
    b = Agent("b", make_config(kind))
    seg = ShmSegment.create(REGION_BYTES)
    src = np.random.default_rng(0).integers(0, 256, REGION_BYTES, dtype=np.uint8)
    try:
        local_region = a.register(src)
        remote_region = b.register(seg)
        a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        yield Pair(kind, a, b, seg, src, local_region, remote_region)
    finally:
        a.close()
        b.close()
        seg.close()
