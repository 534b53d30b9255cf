"""Multi-node pool coordination on etcd: node registration under a lease, a live view of the
members through a watch, and leader election for the cluster-metadata role.

Keys under a cluster prefix (default `/kvtier`):
    {prefix}/nodes/{node_id}   msgpack NodeRecord, attached to the node's lease
    {prefix}/leader            the leader's node id, attached to the leader's lease
A node that dies stops refreshing its lease; etcd deletes both keys when the lease's TTL
runs out, every watcher sees the node leave, and a standby takes the leader key.
"""
