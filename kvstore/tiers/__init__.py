"""Storage tiers. `make_tier` imports an implementation only when it is chosen."""
from __future__ import annotations

from kvstore.tiers.base import Tier

__all__ = ["Tier"]
