"""Messages between nodes and the leader's metadata service (msgpack bodies over HTTP).

Each is a `transfer.codec.Record`: a msgpack array whose first item is its tag (format and
version); a record of another tag, a field of the wrong type or a block hash that is not
16 bytes is a ClusterError the receiver turns into HTTP 400.
"""
from __future__ import annotations

from kvstore.cluster.records import ClusterError
from kvstore.events import KVEvent, TierKind
from kvstore.keys import HashField
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
    """Which nodes hold each of `hashes` (namespace `ns_id`), and the longest prefix per node."""

    ns_id: int
    hashes: tuple[HashField, ...]


class Located(Message, tag="located/2"):
    holders: tuple[tuple[str, ...], ...]   # per hash, the nodes holding it
    prefix: tuple[tuple[str, int], ...]    # (node, leading blocks it holds), longest first
