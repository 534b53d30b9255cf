"""Wire messages between the router and the worker processes (msgpack, never pickle).

Unary calls carry one msgpack body; streams are a sequence of frames, each a 4-byte
big-endian length followed by one msgpack map. Every message carries `version`.
"""
from __future__ import annotations

import dataclasses
import enum
import struct
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

PROTOCOL_VERSION = 2
MSGPACK = "application/msgpack"
_LEN = struct.Struct(">I")
T = TypeVar("T")


class MessageError(ValueError):
    """A message from another process does not parse or has the wrong version."""


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the router about itself (GET /info)."""

    name: str
    role: str
    model: str
    pid: int
    num_blocks: int
    block_tokens: int
    max_model_len: int
    ns_fields: tuple          # Namespace(*ns_fields) rebuilds the worker's block namespace
    threads: int = 1          # its torch threads
    # timings measured at start (serving.calibrate), for the router's cost model:
    prefill_samples: tuple = ()   # (new tokens, cached prefix tokens, seconds)
    decode_samples: tuple = ()    # (batch size, KV tokens, seconds) per decode step
    load_samples: tuple = ()      # (bytes read from the pool, seconds)


@dataclass(frozen=True)
class GenerateRequest:
    """Prefill (role prefill: first token only) or a whole generation (role colocated)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: dict              # SamplingParams fields


@dataclass(frozen=True)
class PrefillResult:
    handoff: bytes            # engine_adapter.Handoff.encode()
    first_token_id: int
    first_text: str
    finished: bool
    finish_reason: str | None
    num_local_hit_tokens: int
    num_loaded_tokens: int
    num_model_tokens: int
    block_hashes: tuple[bytes, ...]   # full prompt blocks now in this worker's cache and the pool


@dataclass(frozen=True)
class TokenEvent:
    """One streamed step: new token ids and the cumulative output text so far."""

    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    num_local_hit_tokens: int = 0
    num_loaded_tokens: int = 0
    num_model_tokens: int = 0
    block_hashes: tuple[bytes, ...] = ()
    error: str | None = None


def pack(msg: Any) -> bytes:
    return msgpack.packb({"version": PROTOCOL_VERSION, **dataclasses.asdict(msg)},
                         use_bin_type=True)


def unpack(cls: type[T], raw: bytes) -> T:
    try:
        d = msgpack.unpackb(raw, raw=False)
    except (ValueError, msgpack.exceptions.ExtraData) as e:
        raise MessageError(f"{cls.__name__}: not msgpack ({e})") from e
    if not isinstance(d, dict) or d.pop("version", None) != PROTOCOL_VERSION:
        raise MessageError(f"{cls.__name__}: not protocol version {PROTOCOL_VERSION}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    try:
        kw = {k: tuple(v) if isinstance(v, list) and "tuple" in str(names[k].type) else v
              for k, v in d.items()}
        return cls(**kw)
    except (KeyError, TypeError) as e:
        raise MessageError(f"{cls.__name__}: bad fields ({e})") from e


def frame(msg: Any) -> bytes:
    body = pack(msg)
    return _LEN.pack(len(body)) + body


async def read_frame(content, cls: type[T]) -> T | None:
    """The next frame from an aiohttp StreamReader; None at a clean end of stream.
    Raises asyncio.IncompleteReadError when the peer vanished mid-frame."""
    if content.at_eof():
        return None
    head = await content.read(_LEN.size)
    if not head:
        return None
    if len(head) < _LEN.size:
        head += await content.readexactly(_LEN.size - len(head))
    (n,) = _LEN.unpack(head)
    return unpack(cls, await content.readexactly(n))
