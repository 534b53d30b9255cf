"""The one contract every block store of kvtier meets: `BlockStore`.

Implemented by the in-process `TieredStore`, the daemon SDK's `Client` and `AsyncClient`
(coroutines of the same names) and the pool's `ClusterClient`, so an engine connector or
plugin takes any of them. The small result types live here, so a module that only talks
to a store (an engine, the SDK) needs nothing from the store's internals.

    put_n(hashes, srcs) -> list[PutStatus]            content-addressed: EXISTS is a success
    get_n(hashes, dsts) -> list[TierKind | None]      None: a miss (absent or corrupted)
    get_prefix_n(hashes, dsts) -> MatchResult         longest stored prefix + its bytes
    contains_n(hashes) -> list[bool]
    match_prefix(hashes) -> MatchResult
    close()

`srcs` / `dsts` are one buffer of n blocks back to back or a sequence of n block buffers
(torch tensors, numpy arrays, bytes-like; destinations writable).
"""
from __future__ import annotations

import enum
from typing import NamedTuple, Protocol, Sequence, runtime_checkable

from kvstore.events import TierKind


class PutStatus(enum.Enum):
    STORED = "stored"        # stored by this call (or by a put of it that committed first)
    EXISTS = "exists"        # already stored (content-addressed: a no-op success); a
    # block another put is still writing is stored again (STORED), whichever commits first
    NO_SPACE = "no_space"    # could not be stored: every tier full of held blocks, or the
    # tier's storage refused it (a full disk); nothing was stored


class MatchResult(NamedTuple):
    num_blocks: int                 # length of the longest stored prefix
    tiers: tuple[TierKind, ...]     # the tier of each of those blocks


def leading_hits(tiers: Sequence[TierKind | None]) -> int:
    """How many of the first blocks were found: the length of the hit prefix."""
    return next((i for i, t in enumerate(tiers) if t is None), len(tiers))


@runtime_checkable
class BlockStore(Protocol):
    def put_n(self, hashes: Sequence[bytes], srcs) -> list[PutStatus]:
        """Store blocks; per block STORED, EXISTS or NO_SPACE."""

    def get_n(self, hashes: Sequence[bytes], dsts) -> list[TierKind | None]:
        """Copy stored blocks into their destinations; per block its tier or None."""

    def get_prefix_n(self, hashes: Sequence[bytes], dsts) -> MatchResult:
        """The longest stored prefix, its blocks copied into the first destinations."""

    def contains_n(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each block is stored."""

    def match_prefix(self, hashes: Sequence[bytes]) -> MatchResult:
        """The longest stored prefix and the tier of each of its blocks."""

    def close(self) -> None:
        """Release the store (memory, connections); later calls raise."""
