"""Messages between nodes and the leader's metadata service (msgpack bodies over HTTP).

Each is a `transfer.codec.Record`: a msgpack array whose first item is its tag (format and
version); a record of another tag, a field of the wrong type or a block hash that is not
16 bytes is a ClusterError the receiver turns into HTTP 400.
"""
from __future__ import annotations

import msgspec

from kvstore.cluster.records import ClusterError
from kvstore.events import KVEvent, TierKind
from kvstore.keys import HashField, Namespace
from transfer.codec import Record


EVENTS_KIND_HEADER = "X-Kvtier-Events"  # "events" or "snapshot": which a reply carries


class Message(Record):
    ERROR = ClusterError


class EventBatch(Message, tag="events/2"):
    """KV events of one namespace store of one node, in seq order."""

    node_id: str
    ns_id: int
    events: tuple[KVEvent, ...]


class Snapshot(Message, tag="snapshot/2"):
    """A node's whole content for one namespace, as of its event `seq`."""

    node_id: str
    ns_id: int
    seq: int
    blocks: dict[TierKind, list[HashField]]


class Locate(Message, tag="locate/2"):
    """Which nodes hold each of `hashes` (namespace `ns_id`), and the longest prefix per node.
    `namespace`: the namespace's fields (`Namespace` keyword arguments), which a tenant's
    client sends so that the leader can check `ns_id` is that tenant's (an admin's may
    leave it empty)."""

    ns_id: int
    hashes: tuple[HashField, ...]
    namespace: dict[str, str | int] = msgspec.field(default_factory=dict)

    def tenant(self) -> str:
        """The tenant of `namespace`, checked to be the namespace `ns_id` names; raises
        ClusterError when it is missing, malformed or another namespace's."""
        try:
            ns = Namespace(**self.namespace)
        except (TypeError, ValueError) as e:
            raise ClusterError(f"locate needs its namespace's fields: {e}") from e
        if ns.ns_id != self.ns_id:
            raise ClusterError(f"the namespace sent is {ns.ns_id:016x}, not {self.ns_id:016x}")
        return ns.tenant


class Located(Message, tag="located/2"):
    holders: tuple[tuple[str, ...], ...]   # per hash, the nodes holding it
    prefix: tuple[tuple[str, int], ...]    # (node, leading blocks it holds), longest first
