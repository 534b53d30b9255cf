"""KVTierConnector under the official vllm==0.33.0 wheel (no CPU forward pass there): vLLM's
real v1 `Scheduler` drives the scheduler-side connector; a stand-in model runner binds the
metadata to a worker-side connector over CPU KV tensors in the CPU backend's layout and
writes, for each token it "computes", KV derived from the token ids (so a load is checkable)."""
import json

import pytest

vllm = pytest.importorskip("vllm", reason="vllm==0.33.0 runs in build/venv-vllm033 (make test-vllm)")
import torch  # noqa: E402

from kvstore.events import TierKind  # noqa: E402
from kvstore.keys import hash_blocks  # noqa: E402
from kvstore.testing import flip_ssd_byte  # noqa: E402

BLOCK, LAYERS, HEADS, HEAD_DIM, NUM_BLOCKS = 32, 2, 2, 32, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def make_vllm_config(model_dir, store_dir, async_load=False):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig)
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=1024)
    return VllmConfig(
        model_config=model, device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=1024,
                                         max_num_seqs=4, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_module_path="engine_adapter.plugins.vllm.connector",
            kv_connector_extra_config={"kvtier_path": str(store_dir), "kvtier_dram_blocks": 0,
                                       "kvtier_async_load": async_load}))


@pytest.fixture
def model_dir(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
           "hidden_size": HEADS * 2 * HEAD_DIM, "intermediate_size": 256, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
           "max_position_embeddings": 2048, "torch_dtype": "float32"}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "model"


class Harness:
    """vLLM's Scheduler + a worker-side connector over CPU KV tensors [nb, H, bt, 2*D]."""

    def __init__(self, vllm_config):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                                KVCacheTensor)
        from vllm.v1.structured_output import StructuredOutputManager
        from engine_adapter.plugins.vllm.connector import KVTierConnector
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
        kv_cfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[
            KVCacheTensor(size=spec.page_size_bytes * NUM_BLOCKS, layers=[n], layer_stride=0,
                          block_stride=spec.page_size_bytes) for n in NAMES],
            kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
        vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.scheduler = Scheduler(vllm_config, kv_cfg, StructuredOutputManager(vllm_config), block_size=BLOCK)
        self.worker = KVTierConnector(vllm_config, KVConnectorRole.WORKER, kv_cfg)
        self.kv = {n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM) for n in NAMES}
        self.worker.register_kv_caches(self.kv)
        self.computed_tokens: dict[str, int] = {}

    def kc_vc(self, name):
        """K and V caches the way vLLM's CPU backend reads them: [nb, H, bt, D] each."""
        return self.kv[name].view(NUM_BLOCKS, HEADS, BLOCK * 2, HEAD_DIM).chunk(2, dim=2)

    @staticmethod
    def expected_kv(layer, tokens):
        """The KV a model would compute: a function of the layer and the token ids so far."""
        t = torch.tensor(tokens, dtype=torch.float32)
        pos = torch.arange(len(tokens), dtype=torch.float32)
        k = (t * 0.5 + pos + layer)[:, None, None].expand(-1, HEADS, HEAD_DIM) + torch.arange(HEADS)[:, None]
        return k, -k

    def step(self, requests, after_start_load=None):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        if after_start_load is not None:
            after_start_load(out)
        sched = {r.req_id: (r.num_computed_tokens, r.block_ids[0]) for r in out.scheduled_new_reqs}
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            req = self.scheduler.requests[rid]
            sched[rid] = (c.num_computed_tokens[i], req_blocks(self.scheduler, rid))
        for rid, (start, blocks) in sched.items():
            n = out.num_scheduled_tokens[rid]
            self.computed_tokens[rid] = self.computed_tokens.get(rid, 0) + n
            self.write(requests[rid].all_token_ids, start, start + n, blocks)
        for name in NAMES:
            self.worker.save_kv_layer(name, self.kv[name], None)
        self.worker.wait_for_save()
        _, recving = self.worker.get_finished(set())
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[7] for _ in ids],
                                kv_connector_output=KVConnectorOutput(finished_recving=recving,
                                                                      invalid_block_ids=errors))
        self.scheduler.update_from_output(out, mro)
        return out

    def write(self, tokens, start, end, blocks):
        pos = torch.arange(start, end)
        bids, offs = torch.tensor(blocks)[pos // BLOCK], pos % BLOCK
        for layer, name in enumerate(NAMES):
            kc, vc = self.kc_vc(name)
            k, v = self.expected_kv(layer, tokens[:end])
            kc[bids, :, offs] = k[start:end]
            vc[bids, :, offs] = v[start:end]

    def check_cache(self, request, num_tokens, layers=range(LAYERS)):
        blocks = req_blocks(self.scheduler, request.request_id)
        pos = torch.arange(num_tokens)
        bids, offs = torch.tensor(blocks)[pos // BLOCK], pos % BLOCK
        for layer in layers:
            kc, vc = self.kc_vc(NAMES[layer])
            k, v = self.expected_kv(layer, request.all_token_ids[:num_tokens])
            assert torch.equal(kc[bids, :, offs], k) and torch.equal(vc[bids, :, offs], v)


def req_blocks(scheduler, req_id):
    return scheduler.kv_cache_manager.get_block_ids(req_id)[0]


def make_request(req_id, tokens, max_tokens=2):
    from vllm import SamplingParams
    from vllm.v1.request import Request
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens), None)


def shared_prompts():
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(1, 512, (300,), generator=g).tolist()
    return prefix, prefix + [11, 12, 13, 14, 15], prefix + torch.randint(1, 512, (40,), generator=g).tolist()


def run_to_end(h, requests, max_steps=20):
    for r in requests.values():
        h.scheduler.add_request(r)
    for _ in range(max_steps):
        if not h.scheduler.has_unfinished_requests():
            return
        h.step(requests)
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("async_load", [False, True])
def test_real_scheduler_loads_the_stored_prefix_into_the_paged_cache(model_dir, tmp_path, async_load):
    h = Harness(make_vllm_config(model_dir, tmp_path / "store", async_load))
    prefix, first, second = shared_prompts()
    run_to_end(h, {"a": make_request("a", first)})
    assert h.worker.worker_side.num_saved_blocks == len(first) // BLOCK
    # the stored block is kvtier's layout [L, 2, bt, H, D] of what vLLM's backend reads
    hashes = hash_blocks(h.worker.ns, first)
    got = torch.empty((2, *h.worker.ns.block_shape))
    assert None not in h.worker.store.get_n(hashes[1:3], got)
    for layer in range(LAYERS):
        k, v = h.expected_kv(layer, first)
        assert torch.equal(got[:, layer, 0].reshape(-1, HEADS, HEAD_DIM), k[BLOCK:3 * BLOCK])
        assert torch.equal(got[:, layer, 1].reshape(-1, HEADS, HEAD_DIM), v[BLOCK:3 * BLOCK])
    b = make_request("b", second)
    h.scheduler.add_request(b)
    seen_load = False
    for _ in range(6):
        out = h.step({"b": b})
        if out.kv_connector_metadata.loads:
            seen_load = True
            if not async_load:
                assert out.num_scheduled_tokens["b"] == len(second) - len(prefix) // BLOCK * BLOCK
                h.check_cache(b, len(second))   # loaded prefix + computed rest, all as expected
        if "b" in out.num_scheduled_tokens and b.num_output_tokens >= 1:
            break
    assert seen_load
    assert h.worker.worker_side.num_loaded_blocks == len(prefix) // BLOCK
    assert h.computed_tokens["b"] < len(second)  # the prefix was not recomputed


def test_a_corrupt_block_is_reported_and_recomputed_by_vllm(model_dir, tmp_path):
    h = Harness(make_vllm_config(model_dir, tmp_path / "store"))
    prefix, first, second = shared_prompts()
    run_to_end(h, {"a": make_request("a", first)})
    store = h.worker.store
    key = bytes(hash_blocks(h.worker.ns, prefix)[4])
    flip_ssd_byte(store, key, offset=1)
    b = make_request("b", second)
    run_to_end(h, {"b": b})
    assert h.worker.worker_side.num_loaded_blocks == 4 and h.worker.worker_side.num_failed_blocks == 5
    assert h.computed_tokens["b"] >= len(second) - 4 * BLOCK    # vLLM recomputed from block 4 on


class GatedStore:
    """The real store, whose reads wait until the test opens the gate."""

    def __init__(self, store, gate):
        self.store, self.gate = store, gate

    def get_n(self, hashes, dsts):
        assert self.gate.wait(60), "the gate was never opened"
        return self.store.get_n(hashes, dsts)


def test_loads_run_in_the_background_and_each_layer_waits_for_its_own(model_dir, tmp_path):
    import threading
    h = Harness(make_vllm_config(model_dir, tmp_path / "store"))
    prefix, first, second = shared_prompts()
    run_to_end(h, {"a": make_request("a", first)})
    loader = h.worker.worker_side.loader
    gate = threading.Event()
    loader.store = GatedStore(loader.store, gate)
    b = make_request("b", second)
    h.scheduler.add_request(b)
    loaded = len(prefix) // BLOCK * BLOCK

    def forward(out):
        assert out.kv_connector_metadata.loads
        # start_load_kv returned while the fetch is held: nothing is in place yet
        assert not any(ev.is_set() for ev in loader.ready)
        gate.set()
        for layer, name in enumerate(NAMES):
            h.worker.wait_for_layer_load(name)      # what vLLM's attention layer calls
            h.check_cache(b, loaded, layers=[layer])
        assert loader.num_layer_waits == LAYERS

    h.step({"b": b}, after_start_load=forward)
    assert loader.num_loaded_blocks == len(prefix) // BLOCK
    h.check_cache(b, len(second))


def test_decode_blocks_are_saved_when_asked(model_dir, tmp_path):
    cfg = make_vllm_config(model_dir, tmp_path / "store")
    cfg.kv_transfer_config.kv_connector_extra_config["kvtier_save_decode"] = True
    h = Harness(cfg)
    prompt = shared_prompts()[0][:2 * BLOCK - 3]            # 61 tokens: one full block
    a = make_request("a", prompt, max_tokens=12)             # decoding fills block 2 (64 tokens)
    run_to_end(h, {"a": a})
    hashes = hash_blocks(h.worker.ns, list(a.all_token_ids))
    assert len(a.all_token_ids) == 73 and len(hashes) == 2
    assert h.worker.store.contains_n(hashes) == [True, True]
    got = torch.empty((1, *h.worker.ns.block_shape))
    assert None not in h.worker.store.get_n(hashes[1:], got)
    k, v = h.expected_kv(0, list(a.all_token_ids))
    assert torch.equal(got[0, 0, 0].reshape(-1, HEADS, HEAD_DIM), k[BLOCK:2 * BLOCK])


def test_kv_of_other_inputs_than_the_token_ids_is_never_loaded(model_dir, tmp_path):
    """A LoRA adapter, images or a cache salt change a request's KV for the same token ids
    (vLLM's own prefix cache keys them too): such a request must not load blocks the plain
    prompt stored, nor another adapter's (an image: none from the block its placeholder
    starts in on; the text before it is shared); prompt embeddings are not named by token
    ids at all, so kvtier stays out of them."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request
    h = Harness(make_vllm_config(model_dir, tmp_path / "store"))
    prefix, first, _ = shared_prompts()
    run_to_end(h, {"a": make_request("a", first)})
    connector = h.scheduler.connector

    def matched(req_id, **kw):
        req = Request(req_id, first, SamplingParams(max_tokens=2), None, **kw)
        return connector.get_num_new_matched_tokens(req, 0)[0]
    adapters = []
    for name in ("ad1", "ad2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_model.safetensors").write_bytes(name.encode() * 100)
        adapters.append(LoRARequest(name, len(adapters) + 1, str(tmp_path / name)))
    assert matched("plain") == len(first) // BLOCK * BLOCK
    assert matched("salted", cache_salt="tenant-x") == 0
    assert matched("lora", lora_request=adapters[0]) == 0
    assert matched("embeds", prompt_embeds=torch.zeros(len(first), 8)) == 0
    # an image: the blocks before the one its placeholder starts in are the text's
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    def image(name):
        return [MultiModalFeatureSpec(None, "image", name, PlaceholderRange(4 * BLOCK + 5, 8))]
    assert matched("image", mm_features=image("img-a")) == 4 * BLOCK
    pic = Request("pic", first, SamplingParams(max_tokens=2), None, mm_features=image("img-a"))
    h.scheduler.connector.scheduler_side.lookup("p", first, 0, (), connector._extra(pic),
                                                connector._marks(pic))
    pic_hashes = h.scheduler.connector.scheduler_side.requests["p"].hashes
    assert pic_hashes[:4] == hash_blocks(h.worker.ns, first)[:4]
    assert pic_hashes[4] != hash_blocks(h.worker.ns, first)[4]
    # with the image request's blocks stored: the same image finds them all, another image
    # only the text before it, and an input with no identifier stays out of kvtier
    ns = h.worker.ns
    connector.store.put_n(pic_hashes, torch.zeros(len(pic_hashes), ns.block_bytes, dtype=torch.uint8))
    assert matched("same-image", mm_features=image("img-a")) == len(first) // BLOCK * BLOCK
    assert matched("other-image", mm_features=image("img-b")) == 4 * BLOCK
    assert matched("no-id", mm_features=image("")) == 0
    # a LoRA request's own blocks are found again by the same adapter, not by another
    lora = Request("lora-run", first, SamplingParams(max_tokens=2), None, lora_request=adapters[0])
    h.scheduler.connector.scheduler_side.lookup("x", first, 0, (), connector._extra(lora))
    hashes = h.scheduler.connector.scheduler_side.requests["x"].hashes
    assert hashes != hash_blocks(h.worker.ns, first)
    other = Request("o", first, SamplingParams(max_tokens=2), None, lora_request=adapters[1])
    assert connector._extra(other) != connector._extra(lora)
