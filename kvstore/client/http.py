"""The control plane from the command line (`kvtier stats`): stdlib HTTP, no event loop."""
from __future__ import annotations

import http.client
import json
import os
import sys
import urllib.error
import urllib.request


def fetch_json(url: str, token: str = "", timeout_s: float = 5.0) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.load(resp)


def print_stats(base_url: str, token: str) -> int:
    base_url = base_url.rstrip("/")
    if any(c in token for c in "\r\n\0"):  # (was blamed on the address: "cannot read ...")
        print("kvtier stats: the token holds a line break or NUL: pass it as one line",
              file=sys.stderr)
        return 2
    try:
        doc = fetch_json(base_url + "/stats", token)
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
    try:
        lines = _stats_lines(doc)
    except (KeyError, TypeError, AttributeError) as e:  # (a KeyError traceback)
        print(f"kvtier stats: {base_url}/stats answered JSON that is not a kvtier daemon's "
              f"stats (no {e}); is this the daemon's control-plane address?", file=sys.stderr)
        return 2
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:  # (`kvtier stats | head`: a BrokenPipeError traceback)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _stats_lines(doc: dict) -> list[str]:
    lines = [f"node {doc['node_id']}: {len(doc['namespaces'])} namespaces"]
    for ns in doc["namespaces"]:
        lines.append(f"  {ns['ns_id']} {ns['model']!r} tenant={ns['tenant']!r} "
                     f"block={ns['block_bytes']}B hits={ns['hits']} misses={ns['misses']} "
                     f"(same-host direct {ns.get('direct_hits', 0)}, leased "
                     f"{ns.get('lease_hits', 0)})")
        for t in ns["tiers"]:
            lines.append(f"    {t['tier']:<5} {t['used_blocks']}/{t['capacity_blocks']} blocks  "
                         f"in {t['bytes_in'] / 2**20:.1f} MiB  out "
                         f"{t['bytes_out'] / 2**20:.1f} MiB  demoted {t['demotions_out']}  "
                         f"evicted {t['evictions']}")
    return lines
