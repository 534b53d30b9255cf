"""Messages between nodes and the leader's metadata service (msgpack bodies over HTTP).

Each is a `transfer.codec.Record`: a msgpack array whose first item is its tag (format and
version); a record of another tag, a field of the wrong type or a block hash that is not
16 bytes is a ClusterError the receiver turns into HTTP 400.
"""
from __future__ import annotations

from kvstore.cluster.records import ClusterError
from kvstore.events import KVEvent, TierKind
from kvstore.keys import HashField, Namespace
from transfer.codec import Record


EVENTS_KIND_HEADER = "X-Kvtier-Events"  # "events" or "snapshot": which a reply carries
TENANT_LOCATE_HASHES = 8192  # the most hashes a tenant's locate may ask about (the leader
# answers more 413; a client asks in pieces of this many): kvstore.daemon.cluster says why


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


class NamespaceRoot(Message, tag="ns-root/1"):
    """A node names a namespace it reports to the leader by its whole root hash, not only the
    64-bit id the index is keyed by: a tenant's locate is answered only for the namespace
    whose root every reporting node gave (two namespaces sharing an id stay apart)."""

    node_id: str
    ns_id: int
    root: HashField


class TenantLocate(Message, tag="locate-tenant/1"):
    """`Locate` for any token: the namespace whole, not its id. The leader computes the id
    itself and checks the namespace's tenant against the token (an id alone would let a
    tenant name another tenant's namespace)."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    revision: str
    tenant: str
    codec: str
    hashes: tuple[HashField, ...]

    @classmethod
    def of(cls, ns: Namespace, hashes) -> "TenantLocate":
        return cls(ns.model, ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.dtype,
                   ns.block_tokens, ns.revision, ns.tenant, ns.codec, tuple(map(bytes, hashes)))

    def namespace(self) -> Namespace:
        """ClusterError for fields no namespace has."""
        try:
            return Namespace(self.model, self.num_layers, self.num_kv_heads, self.head_dim,
                             self.dtype, self.block_tokens, self.revision, self.tenant, self.codec)
        except ValueError as e:
            raise ClusterError(f"not a namespace: {e}") from e


class Located(Message, tag="located/2"):
    holders: tuple[tuple[str, ...], ...]   # per hash, the nodes holding it
    prefix: tuple[tuple[str, int], ...]    # (node, leading blocks it holds), longest first
