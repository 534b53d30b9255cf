"""End to end through `kvtier cluster`: real store, worker and front-end processes on loopback.
Tests share one cluster (model loads are slow) and run in file order: the worker-kill test
and the Ctrl-C test come last."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvstore.daemon.process import freeze

from .cluster_proc import SYSTEM, sse_events

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def metric(cluster, name: str) -> float:
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def test_models_and_cluster_view(cluster):
    models = cluster.get_json("/v1/models")
    assert models["data"][0]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    roles = sorted(w["role"] for w in cluster.get_json("/cluster")["workers"])
    assert roles == ["decode", "decode", "prefill"]


def test_streamed_chat_equals_engine_greedy(cluster, reference):
    from engine_adapter import SamplingParams
    want = reference.generate([reference.chat_prompt(CHAT)],
                              SamplingParams(temperature=0, max_tokens=24))[0]
    _, events = sse_events(cluster.url, "/v1/chat/completions",
                           {"messages": CHAT, "max_tokens": 24, "temperature": 0,
                            "stream_options": {"include_usage": True}})
    text, usage, done = "", None, False
    for data in events:
        if data == "[DONE]":
            done = True
            continue
        msg = json.loads(data)
        assert "error" not in msg, msg
        if msg.get("usage"):
            usage = msg["usage"]
        for choice in msg["choices"]:
            text += choice["delta"].get("content", "")
    assert done and text == want.text
    assert usage["completion_tokens"] == len(want.token_ids)


def test_shared_prefix_reports_cached_tokens(cluster):
    ttft_before = metric(cluster, "kvtier_ttft_seconds_count")
    computed_before = metric(cluster, "kvtier_computed_prompt_tokens_total")
    usages = []
    for question in ("What is a KV cache?", "Why share a prefix between requests?"):
        status, msg = cluster.post_json("/v1/chat/completions", {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0})
        assert status == 200, msg
        usages.append(msg["usage"])
    first, second = usages
    assert second["prompt_tokens"] > 200
    assert second["prompt_tokens_details"]["cached_tokens"] >= 192  # the shared system prompt
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[1] > cached[0]
    computed = metric(cluster, "kvtier_computed_prompt_tokens_total") - computed_before
    # the second prefill computed only its uncached suffix
    assert computed == (first["prompt_tokens"] - first["prompt_tokens_details"]["cached_tokens"]
                        + second["prompt_tokens"] - second["prompt_tokens_details"]["cached_tokens"])
    assert metric(cluster, "kvtier_ttft_seconds_count") - ttft_before == 2
    assert metric(cluster, "kvtier_cached_prompt_tokens_total") > 0


def test_decode_loads_the_handed_off_prompt_from_the_pool(cluster):
    # the prefill answers with its first token before its last blocks are committed; the
    # decode worker waits for them and loads the whole prompt instead of recomputing it
    before = metric(cluster, "kvtier_decode_loaded_tokens_total")
    prompt = SYSTEM + " A question nobody asked before: why is the sky dark at night?"
    status, msg = cluster.post_json("/v1/completions", {"prompt": prompt, "max_tokens": 3,
                                                        "temperature": 0, "ignore_eos": True})
    assert status == 200, msg
    full_blocks = msg["usage"]["prompt_tokens"] // 16
    assert metric(cluster, "kvtier_decode_loaded_tokens_total") - before >= 16 * (full_blocks - 1)


def test_a_prompt_the_pool_lost_but_the_prefill_still_holds_is_saved_again(cluster):
    """The prefill worker finds the prompt in its own cache, the pool has lost it (cleared
    here; evicted in a real run): it saves those blocks again, and the decode worker finds
    them in the pool as it starts. It had saved nothing, and the decode worker waited 10 s
    for the blocks per request, then computed them itself."""
    prompt = SYSTEM + " Asked twice, the pool emptied in between: what is a tide?"
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    status, msg = cluster.post_json("/v1/completions", body)
    assert status == 200, msg
    control = re.search(r"control (http://\S+)", cluster._text()).group(1)

    def pool_blocks() -> int:
        with urllib.request.urlopen(control + "/stats", timeout=10) as r:
            rows = json.loads(r.read())["namespaces"]
        return sum(t["used_blocks"] for row in rows for t in row["tiers"])
    with urllib.request.urlopen(control + "/admin/namespaces", timeout=10) as r:
        ids = [ns["ns_id"] for ns in json.loads(r.read())["namespaces"]]
    for ns_id in ids:
        clear = urllib.request.Request(f"{control}/admin/namespaces/{ns_id}/clear", b"",
                                       method="POST")
        urllib.request.urlopen(clear, timeout=30).close()
    for _ in range(3):  # (the clear ended the workers' store connections: they reconnect)
        cluster.post_json("/v1/completions", {"prompt": "Hello there.", "max_tokens": 2})
    assert pool_blocks() == 0
    status, msg = cluster.post_json("/v1/completions", body)
    assert status == 200, msg
    full_blocks = msg["usage"]["prompt_tokens"] // 16
    assert msg["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * full_blocks - 16
    assert pool_blocks() >= full_blocks - 1  # (in before the decode worker began)


def test_bad_request_is_a_clear_400(cluster):
    status, msg = cluster.post_json("/v1/completions", {"prompt": "hi", "n": 3})
    assert status == 400 and "n = 1" in msg["error"]["message"]
    # parameters that ask for nothing are served (clients send them by default)
    status, msg = cluster.post_json("/v1/completions", {
        "prompt": "hi", "max_tokens": 2, "logprobs": None, "presence_penalty": 0.0,
        "frequency_penalty": 0, "best_of": 1, "echo": False, "logit_bias": {}})
    assert status == 200 and msg["usage"]["completion_tokens"] == 2, msg


def test_odd_requests_are_a_400_or_served_and_the_workers_serve_on(cluster):
    """Each of these was a 500, or (a temperature of NaN or 1e-50: the sampler raised in
    the worker's engine thread, which ended) left every later request to that worker
    hanging."""
    for path, body, why in (
            ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, "temperature"),
            ("/v1/completions", {"prompt": "hi", "seed": 2 ** 70}, "seed"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1e300}, "max_tokens"),
            ("/v1/completions", {"prompt": "hi", "stream_options": [1]}, "stream_options"),
            ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "role"),
            # (these were coerced: "false" streamed, 1.7 served 1 token, {"a": 1} stopped at "a")
            ("/v1/completions", {"prompt": "hi", "stream": "false"}, "stream"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1.7}, "max_tokens"),
            ("/v1/completions", {"prompt": "hi", "stop": {"a": 1}}, "stop"),
            # /cluster/locate: bad bodies were a 500
            ("/cluster/locate", {"prompt": "hi", "max_tokens": "x"}, "max_tokens"),
            ("/cluster/locate", {"prompt": [2 ** 40] * 16}, "token ids"),
            # a 500 (packed for the worker), and parameters silently not applied
            ("/v1/completions", {"prompt": "hi", "top_k": 10 ** 30}, "top_k"),
            ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs"),
            ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, "logprobs"),
            ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
            # token ids past int32 reached the block hashing: a 500
            ("/v1/completions", {"prompt": [2 ** 32] + [1] * 15}, "token ids"),
            # no cache of the workers' size holds it: refused before it was prefilled and
            # its first token streamed, then by the decode worker in an error event
            ("/v1/completions", {"prompt": "hi", "max_tokens": 6000, "stream": True},
             "max_tokens")):
        status, msg = cluster.post_json(path, body)
        assert status == 400 and why in msg["error"]["message"], (body, status, msg)
    req = urllib.request.Request(cluster.url + "/v1/completions",
                                 b'{"prompt": "' + bytes([0xff, 0xfe]) + b'"}',  # not UTF-8
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400
    for _ in range(2):  # (both workers, whichever the router picks)
        status, msg = cluster.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                            "temperature": 1e-50})
        assert status == 200 and msg["usage"]["completion_tokens"] == 2, msg
    # null is the default where the OpenAI API allows it (temperature, top_p, n: a 400)
    status, msg = cluster.post_json("/v1/completions", {
        "prompt": "hi", "max_tokens": 2, "temperature": None, "top_p": None, "n": None})
    assert status == 200 and msg["usage"]["completion_tokens"] == 2, msg


def test_a_stop_string_of_several_tokens_never_shows_in_a_stream(cluster):
    """The streamed deltas add up to the unary answer, with no part of the stop string: a
    stream had sent "answer" of the stop "answer is" before the string was whole and cut,
    and could not take it back."""
    body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
    status, plain = cluster.post_json("/v1/completions", body)
    assert status == 200
    text = plain["choices"][0]["text"]
    words = text.split()
    stop = " ".join(words[2:4])  # two words, several tokens, in the middle
    assert len(words) >= 5 and stop in text, text
    status, unary = cluster.post_json("/v1/completions", {**body, "stop": [stop]})
    want = unary["choices"][0]["text"]
    assert status == 200 and want == text[:text.index(stop)]
    _, events = sse_events(cluster.url, "/v1/completions", {**body, "stop": [stop]})
    got = "".join(json.loads(e)["choices"][0]["text"] for e in events
                  if e != "[DONE]" and json.loads(e).get("choices"))
    assert got == want


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_client_that_leaves_a_stream_ends_its_request(cluster):
    """A client that closed its stream after two events left the request running: the
    decode worker generated on to max_tokens for nobody, and the router counted it in
    flight (its load) until a garbage collection happened to close it."""
    import socket
    from urllib.parse import urlparse
    body = json.dumps({"prompt": "Tell a very long story:", "max_tokens": 3000,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    url = urlparse(cluster.url)
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while got.count(b"data:") < 3:
            got += s.recv(4096)
        head = got.split(b"\r\n\r\n", 1)[0].decode()
    worker = next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                  if line.lower().startswith("x-kvtier-decode-worker"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = cluster.get_json("/cluster")["workers"]
        if all(w["inflight"] == 0 for w in workers):
            break
        time.sleep(0.1)
    assert all(w["inflight"] == 0 for w in workers), workers
    pid = next(w["pid"] for w in workers if w["name"] == worker)
    time.sleep(1.0)  # (the abort reaches the worker's engine loop)
    before = _cpu_s(pid)
    time.sleep(2.0)
    assert _cpu_s(pid) - before < 0.8, "the decode worker kept generating for nobody"
    # (each stream a client left logged a 22-line traceback in its worker)
    assert "ClientConnectionResetError" not in cluster._text()
    status, msg = cluster.post_json("/v1/completions", {"prompt": "Again:", "max_tokens": 3})
    assert status == 200 and msg["usage"]["completion_tokens"] == 3


def test_a_stopped_worker_is_taken_out_of_service_and_comes_back(cluster):
    """A decode worker stopped (SIGSTOP: a hung process) answers nothing: its stream ends
    with an error once it has been silent for --worker-timeout (4 s here), new requests go
    to the other one, and it is back in service once it answers again. Its streams had
    waited for good, /healthz said ok, and new requests were still sent to it."""
    long = {"prompt": "Count slowly:", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    headers, doomed = sse_events(cluster.url, "/v1/completions", long)
    victim = headers["X-Kvtier-Decode-Worker"]
    next(doomed), next(doomed)  # decoding is under way on the victim
    pid = next(w["pid"] for w in cluster.get_json("/cluster")["workers"] if w["name"] == victim)
    freeze(pid)
    try:
        t0 = time.monotonic()
        rest = list(doomed)
        assert time.monotonic() - t0 < 30
        errors = [json.loads(d)["error"] for d in rest if d.startswith("{")
                  and "error" in json.loads(d)]
        assert errors and errors[0]["type"] == "worker_failed", rest[-3:]
        assert "health check" in errors[0]["message"] and victim in errors[0]["message"]
        view = {w["name"]: w for w in cluster.get_json("/cluster")["workers"]}
        assert view[victim]["alive"] and not view[victim]["responsive"]
        for _ in range(2):  # new requests go to the other decode worker
            h, events = sse_events(cluster.url, "/v1/completions",
                                   {"prompt": "Say hi.", "max_tokens": 3})
            assert h["X-Kvtier-Decode-Worker"] != victim and list(events)[-1] == "[DONE]"
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        view = {w["name"]: w for w in cluster.get_json("/cluster")["workers"]}
        if view[victim]["responsive"]:
            break
        time.sleep(0.2)
    assert view[victim]["responsive"], view[victim]


def test_killed_decode_worker_ends_its_stream_with_an_error(cluster):
    long = {"prompt": "Count slowly:", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    headers, doomed = sse_events(cluster.url, "/v1/completions", long)
    victim = headers["X-Kvtier-Decode-Worker"]
    next(doomed), next(doomed)  # decoding is under way on the victim
    result = {}

    def other():
        h, events = sse_events(cluster.url, "/v1/completions",
                               {"prompt": "Say hello.", "max_tokens": 24, "temperature": 0,
                                "ignore_eos": True})
        result["worker"] = h["X-Kvtier-Decode-Worker"]
        result["events"] = list(events)

    t = threading.Thread(target=other)
    t.start()
    while "worker" not in result and t.is_alive():
        time.sleep(0.05)
    assert result.get("worker") not in (None, victim)  # the router spread the load
    pid = next(w["pid"] for w in cluster.get_json("/cluster")["workers"] if w["name"] == victim)
    os.kill(pid, signal.SIGKILL)
    rest = list(doomed)
    errors = [json.loads(d)["error"] for d in rest if d.startswith("{") and "error" in json.loads(d)]
    assert errors and errors[0]["type"] == "worker_failed" and victim in errors[0]["message"]
    assert "[DONE]" not in rest
    t.join(300)
    assert result["events"][-1] == "[DONE]"
    assert not any("error" in json.loads(d) for d in result["events"][:-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # reported dead, and the cluster keeps serving
        workers = {w["name"]: w for w in cluster.get_json("/cluster")["workers"]}
        if not workers[victim]["alive"]:
            break
        time.sleep(0.1)
    assert not workers[victim]["alive"]
    assert victim in cluster.output()
    status, msg = cluster.post_json("/v1/completions", {"prompt": "Again:", "max_tokens": 4})
    assert status == 200 and msg["usage"]["completion_tokens"] == 4


def test_health_says_no_once_no_decode_worker_is_left(cluster):
    """/healthz said ok with only the prefill worker alive, which can serve nothing: a load
    balancer kept sending requests that all failed."""
    workers = cluster.get_json("/cluster")["workers"]
    assert cluster.get_json("/healthz")["ok"]
    for w in workers:
        if w["role"] == "decode" and w["alive"]:
            os.kill(w["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            cluster.get_json("/healthz")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and not json.load(e)["ok"]
            break
        time.sleep(0.1)
    else:
        raise AssertionError("/healthz still says ok with no decode worker alive")


def test_ctrl_c_stops_every_process(cluster):
    pids = [w["pid"] for w in cluster.get_json("/cluster")["workers"]]
    assert cluster.stop() == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not cluster.left_behind  # the store node too, and no process it lost track of
