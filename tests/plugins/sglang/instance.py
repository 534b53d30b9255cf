"""One SGLang instance's storage side, as a child process of a test: SGLang's own host KV pool
(`layout`), filled with the KV of a token sequence as a forward pass would leave it, written
to kvtier through SGLang's storage-backend factory and its cache controller's direct page
path, with `kvtier_url` and the daemon's token from $KVTIER_TOKEN.
`python instance.py '{"tokens": [...], "layout": ..., "url": ...}'`; prints `RESULT {...}`."""
from __future__ import annotations

import importlib.util
import json
import os
import sys


def main(args: dict) -> None:
    spec = importlib.util.spec_from_file_location(
        "sglang_pages", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_pages.py"))
    pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pages)
    tokens = args["tokens"]
    pool = pages.make_host_pool(args["layout"], seed=1)
    idx = pool.alloc(len(tokens))
    pages.write_tokens(pool, idx, pages.computed_kv(tokens))
    backend = pages.create_backend(pages.storage_config(kvtier_url=args["url"]), pool)
    try:
        keys = pages.sglang_keys(tokens)
        stored = pages.ctl_set(backend, pool, keys, idx, direct=True)
        print("RESULT " + json.dumps({"stored": bool(stored), "pages": len(keys)}), flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
