"""`kvtier serve`: one store node. Control plane aiohttp (`app.create_app`), data plane a
framed binary protocol (`kvstore.wire`) served by threads (`dataplane`), one TieredStore per
namespace (`namespaces`), Prometheus metrics in a per-app registry (`metrics`)."""
