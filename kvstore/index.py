"""Cluster block index: which node holds which block hash, and in which tier.

Fed by `KVEvent`s (see `kvstore.events`). Each node numbers its events gap-free; the index
applies them in order, holds a few early arrivals while it waits for a missing one (events
may be reordered on the way), and marks the node *stale* when the gap does not close within
`reorder_window` events. A stale node's blocks are left out of every query until the node
sends a snapshot (`apply_snapshot`), after which buffered newer events are replayed.

Layout, chosen for the query: every node owns one bit; for each hash the index keeps an int
bitmask of the nodes holding it (any tier) and one mask per tier. A prefix query walks the
request's hashes once, AND-ing masks, and stops as soon as no node is left, so its cost is
one dict lookup per block of the longest cached prefix, independent of the node count.

Keys are `BlockHash` bytes in the live system; any hashable key works (the simulator uses
the trace's ids mapped to bytes as well, so the same code runs).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import NamedTuple

from kvstore.events import EventKind, KVEvent, TierKind

BlockKey = Hashable
_TIERS = tuple(TierKind)  # fastest first
_MAX_PENDING_FACTOR = 16  # events kept for replay after a snapshot, x reorder_window


class UnknownNodeError(KeyError):
    """A node id the index has never seen was named where a known node is required."""


class EventOutcome(NamedTuple):
    """What `ClusterIndex.apply` did with one event."""

    applied: int  # events applied now (this one plus buffered ones it unblocked)
    buffered: bool  # held until the missing earlier seq arrives
    stale: bool  # the node is stale after this event (a resync is needed)


class _NodeState:
    __slots__ = ("bit", "next_seq", "stale", "pending", "blocks")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.next_seq = 0  # the seq the index expects next from this node
        self.stale = False
        self.pending: dict[int, KVEvent] = {}  # early events, by seq
        self.blocks: tuple[set, ...] = tuple(set() for _ in _TIERS)  # per tier


class PrefixMatch:
    """Result of `ClusterIndex.query`: per node, how many leading blocks it holds."""

    __slots__ = ("_index", "_hashes", "_lengths")

    def __init__(self, index: ClusterIndex, hashes: Sequence[BlockKey], lengths: dict[str, int]):
        self._index = index
        self._hashes = hashes
        self._lengths = lengths

    def length(self, node_id: str) -> int:
        """Leading blocks of the query that `node_id` holds (0 when none or unknown)."""
        return self._lengths.get(node_id, 0)

    def nodes(self) -> tuple[str, ...]:
        """Nodes holding at least the first block."""
        return tuple(self._lengths)

    def best(self, exclude: Iterable[str] = ()) -> tuple[str | None, int]:
        """(node, length) of the longest prefix, ties to the lowest node id; (None, 0) if none."""
        skip = set(exclude)
        best_node, best_len = None, 0
        for node, n in sorted(self._lengths.items()):
            if n > best_len and node not in skip:
                best_node, best_len = node, n
        return best_node, best_len

    def tiers(self, node_id: str) -> tuple[TierKind, ...]:
        """Fastest tier of each block of `node_id`'s prefix, as of query time."""
        n = self.length(node_id)
        return self._index.tiers_of(node_id, self._hashes[:n])


class ClusterIndex:
    """Cluster-wide map block hash -> (node, tier), fed by KV events.

    Not thread-safe: one owner applies events and answers queries (the scheduler loop).
    """

    def __init__(self, reorder_window: int = 64) -> None:
        if reorder_window < 0:
            raise ValueError(f"reorder_window must be >= 0, got {reorder_window}")
        self.reorder_window = reorder_window
        self._nodes: dict[str, _NodeState] = {}
        self._bit_to_node: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._holders: dict[BlockKey, int] = {}  # hash -> mask of nodes, any tier
        self._tier_holders: tuple[dict[BlockKey, int], ...] = tuple({} for _ in _TIERS)
        self._live_mask = 0  # nodes whose state may be used by queries

    # ---- membership -------------------------------------------------------------------
    def add_node(self, node_id: str, next_seq: int = 0) -> None:
        """Register `node_id`, expecting its next event to carry `next_seq`. Idempotent."""
        if node_id in self._nodes:
            return
        bit = self._free_bits.pop() if self._free_bits else len(self._bit_to_node)
        self._nodes[node_id] = state = _NodeState(bit)
        state.next_seq = next_seq
        self._bit_to_node[bit] = node_id
        self._live_mask |= 1 << bit

    def remove_node(self, node_id: str) -> None:
        """Forget `node_id` and every block it held."""
        state = self._node(node_id)
        self._clear_blocks(state)
        self._live_mask &= ~(1 << state.bit)
        del self._nodes[node_id], self._bit_to_node[state.bit]
        self._free_bits.append(state.bit)

    def node_ids(self) -> tuple[str, ...]:
        return tuple(self._nodes)

    def is_stale(self, node_id: str) -> bool:
        return self._node(node_id).stale

    def stale_nodes(self) -> tuple[str, ...]:
        """Nodes that must send a snapshot before their blocks count again."""
        return tuple(n for n, s in self._nodes.items() if s.stale)

    def next_seq(self, node_id: str) -> int:
        """The seq the index waits for from `node_id`."""
        return self._node(node_id).next_seq

    def mark_stale(self, node_id: str) -> None:
        """Declare `node_id` out of sync (e.g. a gap that outlived a timeout)."""
        state = self._node(node_id)
        state.stale = True
        self._live_mask &= ~(1 << state.bit)

    # ---- events -----------------------------------------------------------------------
    def apply(self, event: KVEvent) -> EventOutcome:
        """Apply one event in seq order; buffer early ones; ignore duplicates and old ones."""
        if event.node_id not in self._nodes:
            self.add_node(event.node_id)
        state = self._nodes[event.node_id]
        if event.seq < state.next_seq:
            return EventOutcome(0, False, state.stale)  # duplicate or already covered
        if event.seq > state.next_seq or state.stale:
            state.pending[event.seq] = event
            if len(state.pending) > self.reorder_window and not state.stale:
                self.mark_stale(event.node_id)
            if len(state.pending) > _MAX_PENDING_FACTOR * (self.reorder_window + 1):
                del state.pending[min(state.pending)]  # a later gap re-marks the node stale
            return EventOutcome(0, True, state.stale)
        return EventOutcome(self._drain(state, event), False, False)

    def apply_n(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def apply_snapshot(
        self, node_id: str, seq: int, blocks: Mapping[TierKind, Iterable[BlockKey]]
    ) -> bool:
        """Replace `node_id`'s state by `blocks`, its full content after event `seq`.

        Buffered events after `seq` are then replayed. Returns False (and changes nothing)
        when the index is already past `seq` and not stale, i.e. the snapshot is outdated.
        """
        if node_id not in self._nodes:
            self.add_node(node_id)
        state = self._nodes[node_id]
        if not state.stale and seq + 1 < state.next_seq:
            return False
        self._clear_blocks(state)
        for tier, hashes in blocks.items():
            self._store(state, TierKind(tier), hashes)
        state.next_seq = seq + 1
        state.stale = False
        self._live_mask |= 1 << state.bit
        state.pending = {s: e for s, e in state.pending.items() if s > seq}
        first = state.pending.pop(state.next_seq, None)
        if first is not None:
            self._drain(state, first)
        return True

    def _drain(self, state: _NodeState, event: KVEvent | None) -> int:
        applied = 0
        while event is not None:
            if event.kind is EventKind.STORED:
                self._store(state, event.tier, event.block_hashes)
            else:
                self._remove(state, event.tier, event.block_hashes)
            state.next_seq += 1
            applied += 1
            event = state.pending.pop(state.next_seq, None)
        return applied

    def _store(self, state: _NodeState, tier: TierKind, hashes: Iterable[BlockKey]) -> None:
        bit = 1 << state.bit
        held, tier_map, holders = state.blocks[tier], self._tier_holders[tier], self._holders
        for h in hashes:
            if h in held:
                continue
            held.add(h)
            tier_map[h] = tier_map.get(h, 0) | bit
            holders[h] = holders.get(h, 0) | bit

    def _remove(self, state: _NodeState, tier: TierKind, hashes: Iterable[BlockKey]) -> None:
        bit = 1 << state.bit
        held, tier_map = state.blocks[tier], self._tier_holders[tier]
        for h in hashes:
            if h not in held:
                continue
            held.discard(h)
            _clear_bit(tier_map, h, bit)
            if not any(h in blocks for blocks in state.blocks):
                _clear_bit(self._holders, h, bit)

    def _clear_blocks(self, state: _NodeState) -> None:
        bit = 1 << state.bit
        for tier, held in zip(_TIERS, state.blocks):
            for h in held:
                _clear_bit(self._tier_holders[tier], h, bit)
                _clear_bit(self._holders, h, bit)
            held.clear()

    # ---- queries ----------------------------------------------------------------------
    def query(self, hashes: Sequence[BlockKey]) -> PrefixMatch:
        """For each live node, the number of leading `hashes` it holds (in any tier)."""
        holders, lengths = self._holders, {}
        alive = self._live_mask
        for i, h in enumerate(hashes):
            held = holders.get(h, 0) & alive
            dropped = alive & ~held
            if dropped:
                self._record(dropped, i, lengths)
            alive = held
            if not alive:
                break
        else:
            self._record(alive, len(hashes), lengths)
        return PrefixMatch(self, hashes, lengths)

    def _record(self, mask: int, length: int, out: dict[str, int]) -> None:
        if length == 0:
            return
        while mask:
            low = mask & -mask
            out[self._bit_to_node[low.bit_length() - 1]] = length
            mask ^= low

    def holders(self, hashes: Sequence[BlockKey]) -> list[tuple[str, ...]]:
        """For each hash, the live (not stale) nodes holding it, in node-id order."""
        out, names = [], {0: ()}  # (names per mask, made once: most masks repeat)
        for h in hashes:
            mask = self._holders.get(h, 0) & self._live_mask
            got = names.get(mask)
            if got is None:
                got = names[mask] = tuple(sorted(node for bit, node in self._bit_to_node.items()
                                                 if mask >> bit & 1))
            out.append(got)
        return out

    def tiers_of(self, node_id: str, hashes: Sequence[BlockKey]) -> tuple[TierKind, ...]:
        """Fastest tier of each of `hashes` on `node_id`; the node must hold all of them."""
        bit = 1 << self._node(node_id).bit
        out = []
        for h in hashes:
            for tier, tier_map in zip(_TIERS, self._tier_holders):
                if tier_map.get(h, 0) & bit:
                    out.append(tier)
                    break
            else:
                raise KeyError(f"node {node_id!r} does not hold block {h!r}")
        return tuple(out)

    def blocks_of(self, node_id: str, tier: TierKind) -> frozenset:
        """What the index believes `node_id` holds in `tier` (for tests and resync checks)."""
        return frozenset(self._node(node_id).blocks[tier])

    def _node(self, node_id: str) -> _NodeState:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise UnknownNodeError(f"node {node_id!r} is not in the index") from None


def _clear_bit(masks: dict[BlockKey, int], key: BlockKey, bit: int) -> None:
    mask = masks.get(key, 0) & ~bit
    if mask:
        masks[key] = mask
    else:
        masks.pop(key, None)
