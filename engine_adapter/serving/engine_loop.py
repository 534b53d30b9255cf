"""The engine's synchronous step loop on its own thread, fed by the worker's async handlers.

Handlers submit requests with a callback; the loop thread adds them between steps (so
concurrent requests batch together), steps while anything is unfinished, and calls each
request's callback with its progress. Callbacks run on the loop thread: they must only hand
the value over (e.g. `asyncio.AbstractEventLoop.call_soon_threadsafe`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from typing import Callable, NamedTuple, Sequence

import torch

from engine_adapter.engine import LLMEngine
from engine_adapter.request import Request
from engine_adapter.sampling import SamplingParams

log = logging.getLogger("kvtier.engine")

# Called with (request, error): error is None for progress, else the request failed.
Callback = Callable[[Request | None, BaseException | None], None]


class _Add(NamedTuple):
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    callback: Callback


class _Abort(NamedTuple):
    request_id: str


class _Call(NamedTuple):
    fn: Callable[[LLMEngine], object]
    done: concurrent.futures.Future


_STOP = object()


class EngineLoop:
    def __init__(self, engine: LLMEngine, after_step: Callable[[], None] | None = None) -> None:
        """`after_step`: called on the loop thread after every step (e.g. to turn cache
        changes into KV events, which only that thread may read)."""
        self.engine, self.after_step = engine, after_step
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callback] = {}
        self._reqs: dict[str, Request] = {}
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               callback: Callback, output_token_ids: Sequence[int] = (),
               generator: torch.Generator | None = None) -> None:
        self._inbox.put(_Add(request_id, prompt_token_ids, params, output_token_ids, generator,
                             callback))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the loop thread, between steps (the engine is not
        thread-safe); its result or exception in the returned future."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(fn, done))
        return done

    def close(self) -> None:
        self._inbox.put(_STOP)
        self._thread.join()
        self.engine.close()

    def _run(self) -> None:
        while True:
            block = not self.engine.has_unfinished
            try:
                while True:
                    item = self._inbox.get(block=block)
                    if item is _STOP:
                        return
                    self._handle(item)
                    block = False
            except queue.Empty:
                pass
            if self.engine.has_unfinished:
                try:
                    self._step()
                except Exception as e:  # (it ended this thread: every request after it hung)
                    log.exception("an engine step failed: its requests end with that error")
                    self._fail_all(e)

    def _fail_all(self, error: Exception) -> None:
        """End every request in flight with `error` (the engine gives back their blocks)."""
        for request_id, callback in list(self._callbacks.items()):
            self._callbacks.pop(request_id, None)
            self._reqs.pop(request_id, None)
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("aborting %s after a failed step failed", request_id)
            callback(None, error)

    def _handle(self, item: _Add | _Abort | _Call) -> None:
        if isinstance(item, _Call):
            if not item.done.set_running_or_notify_cancel():
                return  # (its caller was cancelled: setting a result would raise here, and
                # end this thread)
            try:
                item.done.set_result(item.fn(self.engine))
            except Exception as e:  # (the caller's to handle; the loop goes on)
                item.done.set_exception(e)
            return
        if isinstance(item, _Abort):
            self._callbacks.pop(item.request_id, None)
            self._reqs.pop(item.request_id, None)
            self.engine.abort(item.request_id)
            return
        try:
            req = self.engine.add_request(list(item.prompt_token_ids), item.params, item.request_id,
                                          item.output_token_ids, item.generator)
        except Exception as e:  # bad input: only this request fails
            item.callback(None, e)
            return
        self._callbacks[item.request_id] = item.callback
        self._reqs[item.request_id] = req

    def _step(self) -> None:
        outs = self.engine.step()
        if self.after_step is not None:
            self.after_step()
        for o in outs:
            cb = self._callbacks.get(o.request_id)
            req = self._reqs.get(o.request_id)
            if o.finished:
                self._callbacks.pop(o.request_id, None)
                self._reqs.pop(o.request_id, None)
            if cb is not None and req is not None:
                cb(req, None)
