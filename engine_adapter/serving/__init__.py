"""Serving: `kvtier cluster` (a store node, prefill/decode worker processes, a cache-aware
router and an OpenAI-compatible front end on one host) and `kvtier demo`.

Modules: protocol (wire messages between the router and the workers), engine_loop (the
engine's step loop on its own thread), worker (a worker process: one engine behind a tiny
aiohttp server), router (placement with the conductor policy, load and cache mirrors,
worker liveness), openai_api (request parsing, response bodies), frontend (the aiohttp
app), launcher (`kvtier cluster`), workload + demo (`kvtier demo`).
"""
