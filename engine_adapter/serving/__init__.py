"""Serving: `kvtier cluster` (a store node, prefill/decode worker processes, a cache-aware
router and an OpenAI-compatible front end on one host) and `kvtier demo`.

Modules: protocol (wire messages between the router and the workers), engine_loop (the
engine's step loop on its own thread), worker (a worker process: one engine behind a tiny
aiohttp server), calibrate (its timings, measured at start), kv_events (its paged cache's
KV events), store_node (`kvtier serve` plus its store's KV events for the router),
event_feed (those events into the router's ClusterIndex), costs (the cost model fitted to
the timings), router (placement with the conductor policy, booked load, worker liveness),
openai_api (request parsing, response bodies), frontend (the aiohttp app), launcher
(`kvtier cluster`, the CPU plan), workload + derive (the demo workloads, package data in
data/), replay (the demo's users), report (its table, JSON, chart), demo (`kvtier demo`).
"""
