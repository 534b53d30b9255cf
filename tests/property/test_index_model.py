"""ClusterIndex vs a model of every node's true contents, under event loss, reordering,
duplication and snapshots.

The model keeps, per node, the true per-tier contents after each of its events. At every
step a non-stale node's indexed contents must equal its true contents after the events the
index says it has applied (`next_seq`), and a query must agree with a brute-force prefix
walk over those contents. After a snapshot the node is back in sync."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.events import EventKind, KVEvent, TierKind
from kvstore.index import ClusterIndex

NODES = ("a", "b", "c")
KEYS = [i.to_bytes(16, "little") for i in range(8)]
TIERS = tuple(TierKind)


def _empty():
    return tuple(frozenset() for _ in TIERS)


class IndexModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.index = ClusterIndex(reorder_window=3)
        # history[node][k] = true per-tier contents after the node's first k events
        self.history = {n: [_empty()] for n in NODES}
        self.in_flight: list[KVEvent] = []
        for n in NODES:
            self.index.add_node(n)

    @rule(node=st.sampled_from(NODES), kind=st.sampled_from(EventKind),
          tier=st.sampled_from(TIERS), keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def node_emits(self, node, kind, tier, keys):
        states = self.history[node]
        current = list(states[-1])
        if kind is EventKind.STORED:
            current[tier] = current[tier] | set(keys)
        else:
            current[tier] = current[tier] - set(keys)
        event = KVEvent(kind, node, len(states) - 1, tier, tuple(keys))
        states.append(tuple(current))
        self.in_flight.append(event)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def deliver_any(self, data):
        i = data.draw(st.integers(0, len(self.in_flight) - 1))
        self.index.apply(self.in_flight.pop(i))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def lose_any(self, data):
        i = data.draw(st.integers(0, len(self.in_flight) - 1))
        self.in_flight.pop(i)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def deliver_duplicate(self, data):
        i = data.draw(st.integers(0, len(self.in_flight) - 1))
        self.index.apply(self.in_flight[i])  # stays in flight: delivered twice later

    @rule(node=st.sampled_from(NODES))
    def resync_if_stale(self, node):
        if self.index.is_stale(node):
            self._snapshot(node)

    @rule(node=st.sampled_from(NODES))
    def snapshot(self, node):
        self._snapshot(node)

    def _snapshot(self, node):
        states = self.history[node]
        seq = len(states) - 2  # seq of the node's latest event; -1 when none yet
        ok = self.index.apply_snapshot(node, seq, dict(zip(TIERS, states[-1])))
        if ok:
            assert self.index.next_seq(node) == len(states) - 1

    @invariant()
    def matches_truth_at_applied_seq(self):
        for node in NODES:
            if self.index.is_stale(node):
                continue
            truth = self.history[node][self.index.next_seq(node)]
            for tier in TIERS:
                assert self.index.blocks_of(node, tier) == truth[tier], (node, tier)

    @invariant()
    def query_agrees_with_brute_force(self):
        match = self.index.query(KEYS)
        for node in NODES:
            expected = 0
            if not self.index.is_stale(node):
                held = set().union(*(self.index.blocks_of(node, t) for t in TIERS))
                while expected < len(KEYS) and KEYS[expected] in held:
                    expected += 1
            assert match.length(node) == expected, node
            tiers = match.tiers(node)
            for key, tier in zip(KEYS, tiers):
                assert key in self.index.blocks_of(node, tier)
                assert all(key not in self.index.blocks_of(node, t) for t in TIERS[:tier])


TestIndexModel = IndexModel.TestCase
TestIndexModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
