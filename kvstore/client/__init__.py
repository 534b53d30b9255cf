"""The kvtier SDK: `Client` (blocking) and `AsyncClient` (asyncio) for a `kvtier serve` daemon,
`ClusterClient` for a pool of them, and `connect(url)`, which picks by the URL.

    import kvstore
    from kvstore.keys import Namespace, hash_blocks

    ns = Namespace("HuggingFaceTB/SmolLM2-135M", num_layers=30, num_kv_heads=3, head_dim=64)
    with kvstore.connect("kvtier://127.0.0.1:7481", token="...", namespace=ns) as c:
        hashes = hash_blocks(ns, token_ids)
        c.put_n(hashes, blocks)                 # tensor [n, ...] or a list of buffers
        hit = c.match_prefix(hashes).num_blocks
        c.get_n(hashes[:hit], staging)          # same-host: straight from shared memory
"""
from kvstore.client.aio import AsyncClient
from kvstore.client.errors import ClientError, ConnectError, RequestTimeout
from kvstore.client.sync import Client


def connect(url: str, token: str = "", namespace=None, **options):
    """A `Client` for `kvtier://HOST:PORT` (one daemon), a `ClusterClient` for
    `etcd://HOST:PORT[,...]/PREFIX` or `etcds://...` (a pool, its etcd over TLS);
    `options` go to that class."""
    if url.startswith(("etcd://", "etcds://")):
        from kvstore.client.cluster import ClusterClient
        return ClusterClient(url, token, namespace, **options)
    return Client(url, token, namespace, **options)


__all__ = ["AsyncClient", "Client", "ClientError", "ConnectError", "RequestTimeout", "connect"]
