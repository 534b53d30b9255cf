"""One transformers instance with kvtier prefix offload, as a child process of a test
(`python hf_instance.py '{"prompt": [...], "new_tokens": N, "url": ...}'`): SmolLM2-135M,
the daemon's token from $KVTIER_TOKEN. Prints `RESULT {"tokens": [...], "stats": {...}}`."""
from __future__ import annotations

import json
import sys

import torch


def main(args: dict) -> None:
    from engine_adapter.loader import load_hf_gguf
    from engine_adapter.plugins.base import StoreSpec
    from engine_adapter.plugins.hf import KVTierGenerate
    model, _ = load_hf_gguf()
    kv = KVTierGenerate(model.eval(), StoreSpec.from_options({"kvtier_url": args["url"]}))
    try:
        out = kv.generate(torch.tensor([args["prompt"]]), max_new_tokens=args["new_tokens"], do_sample=False)
    finally:
        kv.close()
    print("RESULT " + json.dumps({"tokens": out[0].tolist(), "stats": kv.last._asdict()}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
