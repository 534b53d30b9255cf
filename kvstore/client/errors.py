"""Errors the SDK raises besides the daemon's own refusals (`kvstore.wire.RemoteError`)."""
from __future__ import annotations

from kvstore.errors import KVStoreError


class ClientError(KVStoreError):
    """Base of SDK-side failures."""


class ConnectError(ClientError, ConnectionError):
    """The daemon cannot be reached (not running, wrong address, or it went away)."""


class RequestTimeout(ClientError, TimeoutError):
    """The daemon did not answer within the client's timeout."""
