"""A serving worker process with a tiny KV cache (4 blocks of 16 tokens, SmolLM2): a request
that can never fit is answered with an error at once, requests that exactly fill the cache
finish, many of them at once all finish (preempting each other) with the tokens each gets
alone, a body that is not the message expected is a 400, and the worker keeps serving. Each
path must end: the tests carry timeouts."""
from __future__ import annotations

import http.client
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from engine_adapter.request import FinishReason
from engine_adapter.sampling import SamplingParams
from engine_adapter.serving.ports import wait_port_file
from engine_adapter.serving.protocol import GenerateRequest, TokenEvent

from .cluster_proc import ROOT

pytestmark = pytest.mark.timeout(400)

NUM_BLOCKS, BT = 4, 16
CAPACITY = NUM_BLOCKS * BT        # token positions with K/V


class WorkerProc:
    """`python -m engine_adapter.serving.worker --role colocated` on a loopback port the
    kernel picks (the worker writes it to a file)."""

    def __init__(self) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="kvtier-worker-")
        self.port_file = os.path.join(self.dir.name, "port")
        cmd = [sys.executable, "-m", "engine_adapter.serving.worker", "--name", "tiny",
               "--role", "colocated", "--port", "0", "--port-file", self.port_file,
               "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "4"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout_s: float = 300.0) -> "WorkerProc":
        deadline = time.monotonic() + timeout_s
        self.port = wait_port_file(self.port_file, self.proc, "the worker", timeout_s)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                self._request("GET", "/info", None)
                return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("the worker did not come up")

    def _request(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            conn.request(method, path, body, {"Content-Type": "application/msgpack"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def generate(self, rid: str, prompt: list[int], max_tokens: int) -> TokenEvent:
        """The last streamed event of a greedy generation (token ids accumulate)."""
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        status, raw = self.post("/generate", GenerateRequest(rid, tuple(prompt), params).encode())
        assert status == 200, raw
        events, pos = [], 0
        while pos < len(raw):
            (n,) = struct.unpack_from(">I", raw, pos)
            events.append(TokenEvent.decode(raw[pos + 4:pos + 4 + n]))
            pos += 4 + n
        assert events and events[-1].finished, events
        return events[-1]

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        return self._request("POST", path, body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.dir.cleanup()


@pytest.fixture(scope="module")
def worker():
    w = WorkerProc()
    try:
        yield w.wait_ready()
    finally:
        w.stop()


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def test_a_request_that_can_never_fit_is_refused_and_the_worker_keeps_serving(worker):
    over = worker.generate("over", prompt(40, 1), CAPACITY + 2 - 40)   # one token past the cache
    assert over.error and "max_tokens" in over.error and "4" in over.error
    too_long = worker.generate("too-long", prompt(CAPACITY + 1, 2), 1)
    assert too_long.error and "prompt needs 5 KV blocks" in too_long.error
    ok = worker.generate("after", prompt(5, 3), 4)
    assert ok.error is None and len(ok.token_ids) == 4


def test_requests_at_the_limit_finish_alone_and_all_at_once(worker):
    shapes = [(40, 1), (20, 2), (63, 3), (8, 4), (33, 5), (CAPACITY, 6)]
    cases = [(f"r{i}", prompt(n, seed), CAPACITY + 1 - n) for i, (n, seed) in enumerate(shapes)]
    alone = {}
    for rid, p, m in cases:
        last = worker.generate(f"alone-{rid}", p, m)
        assert last.error is None and last.finish_reason is FinishReason.LENGTH
        alone[rid] = last.token_ids
        assert len(alone[rid]) == m          # the cache exactly full at the end
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda c: worker.generate(*c), cases))
    for (rid, _, _), last in zip(cases, together):
        assert last.error is None and last.token_ids == alone[rid]
    assert worker.generate("still-serving", prompt(5, 9), 3).error is None
    assert worker.proc.poll() is None


GREEDY = SamplingParams(temperature=0, max_tokens=2)
BAD_BODIES = [
    ("/generate", random.Random(0).randbytes(64), "malformed GenerateRequest"),
    ("/generate", TokenEvent((), "", True, None).encode(), "Invalid value 'token-event/3'"),
    ("/generate", GenerateRequest("ids", ("1", "2"), GREEDY).encode(), "Expected `int`"),
    ("/generate", msgspec.msgpack.encode(["generate/3", "p", [1, 2], {"temperature": -1.0}]),
     "temperature must be >= 0"),
    ("/prefill", GenerateRequest("cut", (1, 2, 3), GREEDY).encode()[:-3], "truncated"),
    ("/decode", GenerateRequest("h", (1, 2), GREEDY).encode(), "bad handoff"),
]


@pytest.mark.parametrize("path, body, why", BAD_BODIES, ids=[why for _, _, why in BAD_BODIES])
def test_a_body_that_is_not_the_message_expected_is_a_400_and_the_worker_keeps_serving(
        worker, path, body, why):
    status, text = worker.post(path, body)
    assert status == 400 and why in text.decode(), text
    assert worker.generate("then", prompt(5, 4), 2).error is None
    assert worker.proc.poll() is None
