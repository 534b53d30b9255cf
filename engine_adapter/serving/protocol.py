"""Wire messages between the router and the worker processes (msgpack, never pickle).

    GET  /info                                    -> WorkerInfo
    POST /prefill   GenerateRequest               -> PrefillResult        (role prefill)
    POST /generate  GenerateRequest               -> TokenEvent frames    (role colocated)
    POST /decode    engine_adapter.workers.Handoff -> TokenEvent frames   (role decode)

Each message is a `transfer.codec.Record`: a msgpack array of its fields in declaration
order, its tag first ("<message>/<version>"). msgspec checks every field while decoding, so
bytes of another message or version, a field of the wrong type, a block hash that is not
16 bytes or sampling parameters SamplingParams refuses are a `MessageError`, which a worker
answers with HTTP 400. A unary call carries one message as its body; a stream is a sequence
of frames, each a 4-byte big-endian length followed by one message.
"""
from __future__ import annotations

import enum
import struct
from typing import TypeVar

from engine_adapter.request import FinishReason
from engine_adapter.sampling import SamplingParams
from kvstore.keys import HashField, Namespace
from kvstore.scheduler.cost_model import DecodeSample, PrefillSample, TransferSample
from transfer.codec import Record

MSGPACK = "application/msgpack"
_LEN = struct.Struct(">I")
M = TypeVar("M", bound=Record)


class MessageError(ValueError):
    """Bytes from another process that are not the message expected (see the module doc)."""


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class Message(Record):
    ERROR = MessageError


class WorkerInfo(Message, tag="worker-info/3"):
    """What a worker tells the router about itself (GET /info)."""

    name: str
    role: Role
    model: str
    pid: int
    num_blocks: int
    block_tokens: int
    max_model_len: int
    ns: Namespace             # the worker's block namespace
    threads: int = 1          # its torch threads
    # timings measured at start (serving.calibrate), for the router's cost model:
    prefill_samples: tuple[PrefillSample, ...] = ()
    decode_samples: tuple[DecodeSample, ...] = ()   # one decode step each
    load_samples: tuple[TransferSample, ...] = ()   # reads from the pool


class GenerateRequest(Message, tag="generate/3"):
    """Prefill (role prefill: first token only) or a whole generation (role colocated)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


class PrefillResult(Message, tag="prefill-result/3"):
    handoff: bytes            # an encoded Handoff: the body the decode worker is sent
    first_token_id: int
    first_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_local_hit_tokens: int
    num_loaded_tokens: int
    num_model_tokens: int
    block_hashes: tuple[HashField, ...]  # full prompt blocks now in this worker's cache and the pool


class TokenEvent(Message, tag="token-event/3"):
    """One streamed step: new token ids and the cumulative output text so far."""

    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_local_hit_tokens: int = 0
    num_loaded_tokens: int = 0
    num_model_tokens: int = 0
    block_hashes: tuple[HashField, ...] = ()
    error: str | None = None


def frame(msg: Record) -> bytes:
    body = msg.encode()
    return _LEN.pack(len(body)) + body


async def read_frame(content, cls: type[M]) -> M | None:
    """The next frame from an aiohttp StreamReader; None at a clean end of stream.
    Raises asyncio.IncompleteReadError when the peer vanished mid-frame, and cls.ERROR
    when the frame is not a `cls`."""
    if content.at_eof():
        return None
    head = await content.read(_LEN.size)
    if not head:
        return None
    if len(head) < _LEN.size:
        head += await content.readexactly(_LEN.size - len(head))
    (n,) = _LEN.unpack(head)
    return cls.decode(await content.readexactly(n))
