"""The one message codec of kvtier: msgspec Structs encoded as msgpack arrays.

Every format kvtier sends or stores (the daemon's wire frames, the cluster's messages and
node records, transfer-agent metadata, the serving router's and workers' messages, the
engine's prefill-to-decode handoff) is a `Record`: its fields in declaration order, first
a tag naming the format and its version, so a record of another kind or version is refused
by name. msgspec checks every field's type while decoding, in C, and builds nothing a
schema does not name. It sits at the bottom layer so the transfer layer can use it too.
"""
from __future__ import annotations

from typing import ClassVar, TypeVar

import msgspec

R = TypeVar("R", bound="Record")
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}


class Record(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Subclass with `tag="<format>/<version>"`; set ERROR to the exception a malformed
    record raises (it gets one message argument)."""

    ERROR: ClassVar[type[Exception]] = ValueError

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls: type[R], raw: bytes) -> R:
        decoder = _DECODERS.get(cls)
        if decoder is None:
            decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
        try:
            return decoder.decode(raw)
        except msgspec.DecodeError as e:
            raise cls.ERROR(f"malformed {cls.__name__}: {e}") from e
