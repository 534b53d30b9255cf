"""Serving: `kvtier cluster` (a store node, prefill/decode worker processes, a cache-aware
router and an OpenAI-compatible front end on one host), which `kvtier demo` drives.

Modules: protocol (wire messages between the router and the workers), engine_loop (the
engine's step loop on its own thread), worker (a worker process: one engine behind a tiny
aiohttp server), calibrate (its timings, measured at start), kv_events (its paged cache's
KV events; the store node's come from `kvtier serve`'s GET /kv/events), event_feed (those
events into the router's ClusterIndex), costs (the cost model fitted to the timings), router (placement with the conductor policy, booked load, worker liveness),
openai_api (request parsing, response bodies), frontend (the aiohttp app), ports (a worker
tells the launcher the port the kernel gave it), launcher (`kvtier cluster`, the CPU plan).
The demo's workloads, users and report live in the app layer (`kvtier.workload`,
`kvtier.replay`, `kvtier.demo_report`, `kvtier.demo`).
"""
