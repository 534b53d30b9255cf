"""The vLLM connector's scheduler side names a multimodal request's blocks as vLLM's own
prefix cache does: an image's content goes into the hash of the block its placeholder starts
in, and through the chain into every later one. (Every block was salted with every image:
text ahead of the first image was never shared.) Plain state and a real store, no vLLM."""
import numpy as np

from engine_adapter.plugins.vllm.scheduler_side import SchedulerSide, hash_marked
from kvstore.config import StoreConfig, TierConfig
from kvstore.events import TierKind
from kvstore.keys import Namespace, hash_blocks
from kvstore.store import TieredStore

NS = Namespace("vlm", num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4)
BT = NS.block_tokens
PLACEHOLDER = 9  # the token id every image's placeholder repeats


def prompt(image_at: int, n_tokens: int = 6 * BT + 2) -> list[int]:
    toks = list(range(100, 100 + n_tokens))
    toks[image_at:image_at + 3] = [PLACEHOLDER] * 3
    return toks


def test_blocks_before_an_image_are_the_text_ones_and_each_image_names_the_rest():
    toks = prompt(2 * BT + 1)
    text = hash_blocks(NS, toks)
    cat = hash_marked(NS, toks, 0, None, b"", {2: b"mm|cat"})
    dog = hash_marked(NS, toks, 0, None, b"", {2: b"mm|dog"})
    assert cat[:2] == text[:2] == dog[:2]
    assert all(c != t and c != d for c, t, d in zip(cat[2:], text[2:], dog[2:]))
    # chained: hashing on from any block gives the same chain
    rest = hash_marked(NS, toks[3 * BT:], 3, cat[2], b"", {2: b"mm|cat"})
    assert rest == cat[3:]
    assert hash_marked(NS, toks, 0, None, b"x", {}) == hash_blocks(NS, toks, extra=b"x")


def test_a_stored_image_request_shares_only_its_text_prefix():
    store = TieredStore(NS, StoreConfig((TierConfig(TierKind.DRAM, 64),)))
    side = SchedulerSide(NS, store)
    toks = prompt(3 * BT)
    side.lookup("cat", toks, 0, toks, b"", {3: b"mm|cat"})
    cat = side.requests["cat"].hashes
    store.put_n(cat, np.zeros((len(cat), NS.block_bytes), np.uint8))
    # the same image again: every loadable block; no image or another: the text before it
    assert side.lookup("cat2", toks, 0, toks, b"", {3: b"mm|cat"})[0] == 6 * BT
    assert side.lookup("text", toks, 0, toks, b"")[0] == 3 * BT
    assert side.lookup("dog", toks, 0, toks, b"", {3: b"mm|dog"})[0] == 3 * BT


def test_an_image_in_the_prompts_partial_block_marks_it_once_decode_fills_it():
    """Placeholder token ids are the same for every image: the block that holds the start of
    one, hashed once decoding has filled it, must name that image, or another image's request
    of the same tokens would load its KV."""
    store = TieredStore(NS, StoreConfig((TierConfig(TierKind.DRAM, 64),)))
    side = SchedulerSide(NS, store, save_decode=True)
    toks = prompt(6 * BT)  # 6 full blocks, the image starts in the 7th (partial)
    runs = {}
    for name, marks in (("cat", {6: b"mm|cat"}), ("dog", {6: b"mm|dog"}), ("text", {})):
        live = list(toks)
        side.lookup(name, toks, 0, live, b"", marks)
        assert len(side.requests[name].hashes) == 6
        live += [7] * (2 * BT)  # outputs fill block 6 and 7
        side._hash_decode_blocks(side.requests[name], 8)
        runs[name] = side.requests[name].hashes
    assert runs["cat"][:6] == runs["dog"][:6] == runs["text"][:6]
    assert len({bytes(r[6]) for r in runs.values()}) == 3
    assert len({bytes(r[7]) for r in runs.values()}) == 3
