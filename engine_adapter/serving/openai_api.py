"""The OpenAI-compatible edge: parse request JSON into typed requests, format responses.

Supported: `/v1/completions` (prompt: a string, a list of token ids, or a list of one of
those) and `/v1/chat/completions` (messages), n = 1, `max_tokens` (chat also
`max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop`, `stream`,
`stream_options.include_usage`; extensions `top_k` and `ignore_eos`. Parameters it does
not implement (logprobs, penalties, tools...) are refused when they ask for something
(`UNSUPPORTED`), accepted at their do-nothing values. Usage reports
`prompt_tokens_details.cached_tokens`: prompt tokens whose KV came from a cache (the
worker's own paged cache or the pool) instead of being computed.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from engine_adapter.config import bool_field

DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """The request JSON is not something this server can serve; the message says why."""


@dataclass(frozen=True)
class ApiRequest:
    chat: bool
    model: str
    prompt: Any                 # str, list[int] or list of chat messages
    params: dict                # SamplingParams fields
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


# OpenAI parameters this server does not implement, each with the values that ask for
# nothing (what clients send by default): any other value is refused, never ignored (a
# request for logprobs got 200 with "logprobs": null, penalties were silently not applied)
UNSUPPORTED = {"logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "suffix": ("",),
               "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,),
               "repetition_penalty": (1,), "best_of": (1,), "tools": ([],), "functions": ([],),
               "tool_choice": ("none",), "response_format": ({"type": "text"},)}


def parse(body: Any, chat: bool, default_model: str) -> ApiRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):  # (null: the default)
        raise BadRequest("only n = 1 is supported")
    for key, nothing in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and not any(  # (False is not 0: legacy logprobs=0 asks)
                value == v and isinstance(value, bool) == isinstance(v, bool) for v in nothing):
            raise BadRequest(f"'{key}' is not supported by this server (got {value!r})")
    if chat:
        prompt = body.get("messages")
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str)
                and isinstance(m.get("role"), str) for m in prompt):  # (no role: the chat
            # template raised, a 500)
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                            and all(_token_id(t) for t in prompt))):
            raise BadRequest("'prompt' must be a string or a list of token ids (integers in "
                             "[0, 2**31): one prompt)")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):  # (a list here raised AttributeError: a 500)
        raise BadRequest("'stream_options' must be an object, e.g. {\"include_usage\": true}")
    return ApiRequest(chat, str(body.get("model") or default_model), prompt, _params(body, chat),
                      _flag(body, "stream"), _flag(options, "include_usage"))


def _token_id(t: Any) -> bool:
    """(2**32 had reached the block hashing, which packs ids as int32: a 500)"""
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31


def _flag(body: dict, key: str) -> bool:
    return bool_field(body, key, BadRequest, f"'{key}'")


def _number(body: dict, key: str, default: float) -> float:
    """A number field; null (which the OpenAI API allows) or absent: `default`."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{key}' must be a number, not {value!r}")
    return float(value)


def _params(body: dict, chat: bool) -> dict:
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:  # (not `or`: 0 became the default, silently)
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):  # (1.7 served 1 token)
        raise BadRequest(f"'max_tokens' must be an integer, not {max_tokens!r}")
    p: dict = {"max_tokens": max_tokens, "temperature": _number(body, "temperature", 1.0),
               "top_p": _number(body, "top_p", 1.0)}
    stop = body.get("stop")
    if stop:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            # ({"a": 1} was taken for the stop string "a")
            raise BadRequest(f"'stop' must be a string or a list of strings, not {stop!r}")
        p["stop"] = stop
    for key in ("seed", "top_k", "ignore_eos"):
        if body.get(key) is not None:
            p[key] = body[key]
    return p


def chunk(req: ApiRequest, rid: str, text: str, finish_reason: str | None, first: bool) -> dict:
    if req.chat:
        delta: dict = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": req.model,
            "choices": [choice]}


def usage_chunk(req: ApiRequest, rid: str, usage: Usage) -> dict:
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": req.model,
            "choices": [], "usage": usage.to_json()}


def response(req: ApiRequest, rid: str, text: str, finish_reason: str | None, usage: Usage) -> dict:
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish_reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": req.model,
            "choices": [choice], "usage": usage.to_json()}


def error_body(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
