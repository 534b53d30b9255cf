"""Random placement: the baseline with no information at all."""
from __future__ import annotations

import random as _random

from kvstore.scheduler.base import (ClusterView, Placement, PolicyKind, Request,
                                    SchedulerConfig, no_instance)


class RandomPolicy:
    kind = PolicyKind.RANDOM

    def __init__(self, config: SchedulerConfig, seed: int = 0) -> None:
        self.config = config
        self._rng = _random.Random(seed)

    def place(self, request: Request, view: ClusterView) -> Placement:
        missing = no_instance(view)
        if missing:
            return missing
        prefill = self._rng.choice(view.prefill)
        decode = self._rng.choice(view.decode)
        return Placement(prefill.node_id, decode.node_id)
