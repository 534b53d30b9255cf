"""A daemon's reports to the cluster leader (ClusterAgent.ship_once), round by round, against
the leader's own logic (MetadataService) with the HTTP hop left out: a real registry and
real stores on one side, the leader's index and roots on the other. The pool tests
(tests/integration/cluster) run the same over real sockets and a real etcd."""
import asyncio

import numpy as np
import pytest

from kvstore.cluster.messages import EventBatch, Locate, NamespaceRoot, Snapshot
from kvstore.cluster.records import NodeRecord
from kvstore.daemon.cluster import ClusterAgent, MetadataService
from kvstore.daemon.config import ADMIN, DaemonConfig
from kvstore.daemon.namespaces import Registry
from kvstore.keys import Namespace, hash_blocks

NS = Namespace("shipper", num_layers=1, num_kv_heads=1, head_dim=64)
OTHER = Namespace("shipper-other", num_layers=1, num_kv_heads=1, head_dim=64)


class Leader:
    """The leader's side of the three report routes, as kvstore.daemon.cluster answers them."""

    def __init__(self) -> None:
        self.service = MetadataService({"a": None, "b": None, "L": None})
        self.posts: list[str] = []

    async def post(self, rec, what: str, body: bytes) -> bytes:
        self.posts.append(what)
        if what == "namespace":
            self.service.note_root(NamespaceRoot.decode(body))
        elif what == "snapshot":
            self.service.apply_snapshot(Snapshot.decode(body))
        elif self.service.apply_events(EventBatch.decode(body)):
            return b"resync"
        return b"ok"

    def holders(self, ns: Namespace, hashes) -> tuple:
        return self.service.locate(Locate(ns.ns_id, tuple(hashes))).holders


@pytest.fixture
def node(tmp_path):
    cfg = DaemonConfig(data_dir=str(tmp_path / "data"), dram_bytes=1 << 20, ssd_bytes=0,
                       cluster="etcd://127.0.0.1:1/shipper-test", node_id="a")
    registry = Registry(cfg)
    agent = ClusterAgent(cfg, registry, 1, 2)  # (never started: nothing reaches etcd)
    agent.member.members["L"] = NodeRecord("L", "127.0.0.1:1", "http://127.0.0.1:2")
    agent.member.leader_id, agent.member._leader_lease = "L", 7
    leader = Leader()
    agent._post = leader.post
    yield registry, agent, leader
    registry.close()


def put(hosted, seed: int, n: int = 2) -> list[bytes]:
    hashes = hash_blocks(hosted.ns, list(range(seed * 1000, seed * 1000 + n * hosted.ns.block_tokens)))
    hosted.store.put_n(hashes, np.zeros((n, hosted.ns.block_bytes), np.uint8))
    return hashes


def ship(agent, rounds: int = 1) -> None:
    for _ in range(rounds):
        asyncio.run(agent.ship_once())


def test_a_namespace_cleared_before_its_first_snapshot_takes_its_root_with_it(node):
    """Its root went out, its store closed before the snapshot: the next round reports it
    gone, and the leader keeps no root of this node for the id (a root left behind spoke
    for the id for the rest of the term: with another namespace of the id, every tenant
    locate of it a 409)."""
    registry, agent, leader = node
    hosted = registry.open(NS, ADMIN)
    real = hosted.snapshot

    def cleared_meanwhile():
        registry.clear(hosted)
        return real()  # (the store is closed now: StoreClosedError)

    hosted.snapshot = cleared_meanwhile
    ship(agent)
    assert leader.posts == ["namespace"] and leader.service.roots.get(NS.ns_id)
    ship(agent)
    assert leader.posts[-1] == "snapshot" and not leader.service.roots.get(NS.ns_id)


def test_one_namespace_failing_holds_up_neither_the_others_nor_itself_for_long(node, monkeypatch):
    """A namespace whose report fails (a bug, say) is set aside for a while; the others are
    reported as ever, and the shipper goes on (it used to end, reporting nothing again)."""
    registry, agent, leader = node
    bad, good = registry.open(NS, ADMIN), registry.open(OTHER, ADMIN)

    def broken():
        raise RuntimeError("a bug")

    bad.snapshot = broken
    blocks = put(good, 1)
    ship(agent, 3)
    assert leader.holders(OTHER, blocks) == (("a",), ("a",))
    assert leader.posts.count("namespace") == 2  # the bad one tried once, then set aside
    del bad.snapshot  # mended: reported once its time out is over
    monkeypatch.setattr(agent, "_held_off", {})
    ship(agent)
    assert "a" in leader.service.empty[NS.ns_id]  # (it holds no block: in no index)
    assert NS.ns_id not in leader.service.indexes


def test_an_empty_namespace_reports_once_and_its_first_blocks_come_through_a_resync(node):
    """A fresh namespace's snapshot is empty ({tier: []}): the leader notes the node holds
    none; its idle reports are no resync; its first blocks are answered resync, and the
    snapshot that follows lists them."""
    registry, agent, leader = node
    hosted = registry.open(NS, ADMIN)
    ship(agent)
    assert leader.posts == ["namespace", "snapshot"] and "a" in leader.service.empty[NS.ns_id]
    agent._posted_at[NS.ns_id] = 0.0  # (an idle while: the empty report is due)
    ship(agent)
    assert leader.posts[-1] == "events" and NS.ns_id in agent._known  # answered ok
    blocks = put(hosted, 2)
    ship(agent, 2)
    assert leader.posts[-3:] == ["events", "namespace", "snapshot"]
    assert leader.holders(NS, blocks) == (("a",), ("a",))
    assert leader.service.verified(NS) is True
