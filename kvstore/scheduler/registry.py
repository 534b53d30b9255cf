"""Policy registry: a `PolicyKind` names a policy; its module is imported only when chosen."""
from __future__ import annotations

import importlib

from kvstore.scheduler.base import Policy, PolicyKind, SchedulerConfig

_IMPLEMENTATIONS: dict[PolicyKind, tuple[str, str]] = {
    PolicyKind.RANDOM: ("kvstore.scheduler.random", "RandomPolicy"),
    PolicyKind.ROUND_ROBIN: ("kvstore.scheduler.round_robin", "RoundRobinPolicy"),
    PolicyKind.LEAST_LOADED: ("kvstore.scheduler.least_loaded", "LeastLoadedPolicy"),
    PolicyKind.PREFIX: ("kvstore.scheduler.prefix", "PrefixPolicy"),
    PolicyKind.CONDUCTOR: ("kvstore.scheduler.conductor", "ConductorPolicy"),
}


def make_policy(kind: PolicyKind, config: SchedulerConfig | None = None,
                seed: int = 0) -> Policy:
    """A fresh policy of `kind` (random and round-robin start from `seed`)."""
    if not isinstance(kind, PolicyKind):
        raise TypeError(f"make_policy needs a PolicyKind, got {kind!r}")
    module_name, class_name = _IMPLEMENTATIONS[kind]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(config or SchedulerConfig(), seed)
