"""Consistent hashing over the live nodes: where a new block goes when no node is local.

Each node owns `vnodes` points on a 64-bit ring (xxh3_64 of "node_id#i"); a block belongs to
the first `replicas` distinct nodes clockwise from xxh3_64(block hash). A node joining or
leaving moves only the blocks next to its own points.
"""
from __future__ import annotations

import bisect
from typing import Iterable

import xxhash


class HashRing:
    def __init__(self, node_ids: Iterable[str] = (), vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._nodes: set[str] = set()
        for node_id in node_ids:
            self.add(node_id)

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(self._nodes)

    def add(self, node_id: str) -> None:
        if node_id in self._nodes:
            return
        self._nodes.add(node_id)
        for i in range(self.vnodes):
            point = xxhash.xxh3_64_intdigest(f"{node_id}#{i}".encode())
            at = bisect.bisect(self._points, point)
            self._points.insert(at, point)
            self._owners.insert(at, node_id)

    def remove(self, node_id: str) -> None:
        if node_id not in self._nodes:
            return
        self._nodes.discard(node_id)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != node_id]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def owners(self, key: bytes, replicas: int = 1) -> list[str]:
        """The nodes that hold `key`: `replicas` distinct ones (fewer if the ring is smaller)."""
        if not self._points:
            return []
        want = min(replicas, len(self._nodes))
        at = bisect.bisect(self._points, xxhash.xxh3_64_intdigest(key))
        out: list[str] = []
        for step in range(len(self._points)):
            owner = self._owners[(at + step) % len(self._points)]
            if owner not in out:
                out.append(owner)
                if len(out) == want:
                    break
        return out
