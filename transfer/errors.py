"""The one exception of the transfer layer: `TransferError`, naming the transfer and the cause."""
from __future__ import annotations

import enum
import errno

# what accept() raises when the process (or host) is out of descriptors or memory: a
# listener pauses and retries, never gives up (both the agent's and the daemon's)
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Fault(enum.Enum):
    """Why a transfer (or a call on the agent) failed; lets callers branch without parsing text."""

    INVALID = "invalid argument"
    OUT_OF_RANGE = "descriptor out of the registered range"
    UNREGISTERED = "memory not registered (or not exported)"
    UNKNOWN_PEER = "unknown peer"
    PEER_GONE = "peer has gone away"
    CONNECTION_LOST = "connection lost"
    PROTOCOL = "malformed frame"
    TIMEOUT = "timed out"
    REMOTE = "the peer rejected the request"
    UNSUPPORTED = "not supported by this backend"
    CLOSED = "agent closed"
    REFUSED = "refused by the peer"


class TransferError(Exception):
    """A transfer, a registration or a peer operation failed.

    `transfer` names the transfer ("agent#id op peer") or is None for calls that are not a
    transfer; `fault` is the machine-readable cause, `cause` the human-readable detail.
    """

    def __init__(self, fault: Fault, cause: str, transfer: str | None = None):
        self.fault = fault
        self.cause = cause
        self.transfer = transfer
        where = f"transfer {transfer}: " if transfer else ""
        super().__init__(f"{where}{fault.value}: {cause}")

    def for_transfer(self, transfer: str) -> "TransferError":
        """The same error, now naming `transfer` (keeps the fault and the cause)."""
        return TransferError(self.fault, self.cause, transfer)
