"""The control plane from the command line (`kvtier stats`): stdlib HTTP, no event loop."""
from __future__ import annotations

import http.client
import json
import sys
import urllib.error
import urllib.request


def fetch_json(url: str, token: str = "", timeout_s: float = 5.0) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.load(resp)


def print_stats(base_url: str, token: str) -> int:
    try:
        doc = fetch_json(base_url.rstrip("/") + "/stats", token)
    except urllib.error.HTTPError as e:
        print(f"kvtier stats: {base_url} answered {e.code}: {e.read().decode().strip()}",
              file=sys.stderr)
        return 2
    except (OSError, http.client.HTTPException, ValueError) as e:
        what = "not an HTTP answer" if isinstance(e, http.client.HTTPException) else \
            type(e).__name__ if isinstance(e, ValueError) else str(e)
        print(f"kvtier stats: cannot read {base_url}/stats ({what}); is `kvtier serve` running "
              "and is this its control-plane (--http-port) address, not the data plane?",
              file=sys.stderr)
        return 2
    print(f"node {doc['node_id']}: {len(doc['namespaces'])} namespaces")
    for ns in doc["namespaces"]:
        print(f"  {ns['ns_id']} {ns['model']!r} tenant={ns['tenant']!r} block={ns['block_bytes']}B "
              f"hits={ns['hits']} misses={ns['misses']} (same-host direct "
              f"{ns.get('direct_hits', 0)}, leased {ns.get('lease_hits', 0)})")
        for t in ns["tiers"]:
            print(f"    {t['tier']:<5} {t['used_blocks']}/{t['capacity_blocks']} blocks  "
                  f"in {t['bytes_in'] / 2**20:.1f} MiB  out {t['bytes_out'] / 2**20:.1f} MiB  "
                  f"demoted {t['demotions_out']}  evicted {t['evictions']}")
    return 0
