"""Random placement: the baseline with no information at all."""
from __future__ import annotations

import random as _random

from kvstore.scheduler.base import (PolicyBase, ClusterView, Placement, PolicyKind, RouteRequest,
                                    SchedulerConfig)


class RandomPolicy(PolicyBase):
    kind = PolicyKind.RANDOM

    def __init__(self, config: SchedulerConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._rng = _random.Random(seed)

    def choose(self, request: RouteRequest, view: ClusterView) -> Placement:
        prefill = self._rng.choice(view.prefill)
        decode = self._rng.choice(view.decode)
        return Placement(prefill.node_id, decode.node_id)
