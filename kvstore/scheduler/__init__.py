"""Cache-locality placement: policies behind one contract, a cost model, a simulator."""
from kvstore.scheduler.base import (ClusterView, DecodeLoad, Placement, Policy, PolicyKind,
                                    PrefillLoad, RejectReason, RouteRequest, SchedulerConfig)
from kvstore.scheduler.registry import make_policy

__all__ = [
    "ClusterView", "DecodeLoad", "Placement", "Policy", "PolicyKind", "PrefillLoad",
    "RejectReason", "RouteRequest", "SchedulerConfig", "make_policy",
]
