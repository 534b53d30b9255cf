"""The engine side of kvtier: a Llama-architecture model on the paged kernels, a paged block
manager with prefix caching, a continuous-batching step loop, prefill/decode workers and a
connector that loads and saves prefix blocks through a KV store.

    from engine_adapter import LLMEngine, EngineConfig, SamplingParams, load_smollm2
    from kvstore.config import StoreConfig, TierConfig
    from kvstore.store import TieredStore

    model, tokenizer = load_smollm2()                       # or random_model / from_hf_dir / ...
    engine = LLMEngine(model, EngineConfig(), tokenizer=tokenizer)
    store = TieredStore(engine.ns, StoreConfig(tiers=(TierConfig("dram", 4096),)))
    engine = LLMEngine(model, EngineConfig(), tokenizer=tokenizer, store=store)
    out = engine.generate([engine.chat_prompt([{"role": "user", "content": "Hi"}])],
                          SamplingParams(temperature=0, max_tokens=32))[0]
    out.token_ids, out.text, out.num_loaded_tokens       # prefix tokens that came from the store
    engine.close()                                       # flush pending saves

Modules: config (ModelConfig, EngineConfig), model (LlamaForCausalLM), loader, block_pool
(KVCacheBlock, BlockPool), scheduler, model_runner, sampling (SamplingParams), engine
(LLMEngine), connector (KVStoreLike, StoreConnector), workers (Worker, PrefillWorker,
DecodeWorker, Handoff). Of kvtier's packages only the app layer (kvtier/) imports this one.
"""
from engine_adapter.config import EngineConfig, ModelConfig
from engine_adapter.connector import KVStoreLike, StoreConnector
from engine_adapter.engine import LLMEngine
from engine_adapter.errors import EngineError, InvalidRequestError, ModelLoadError
from engine_adapter.loader import (from_hf_dir, from_transformers, load_hf_gguf, load_smollm2,
                                   random_model)
from engine_adapter.request import FinishReason, RequestOutput
from engine_adapter.sampling import SamplingParams
from engine_adapter.workers import DecodeWorker, Handoff, PrefillWorker, Worker

__all__ = [
    "EngineConfig", "ModelConfig", "KVStoreLike", "StoreConnector", "LLMEngine", "EngineError",
    "InvalidRequestError", "ModelLoadError", "from_hf_dir", "from_transformers", "load_hf_gguf",
    "load_smollm2", "random_model", "FinishReason", "RequestOutput", "SamplingParams",
    "DecodeWorker", "Handoff", "PrefillWorker", "Worker",
]
