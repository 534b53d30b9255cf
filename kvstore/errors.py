"""Errors raised by the store. A miss is never an error: it is a value (None / False).

Every error carries a message that says what was wrong and what to do about it.
"""
from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error kvstore raises on bad input or a broken promise."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is invalid (tier size, watermarks, unknown tier name...)."""


class UnknownTierError(ConfigError):
    """A tier name or kind that no implementation provides."""


class BlockSizeError(KVStoreError, ValueError):
    """A block payload does not have the size, dtype or shape of its namespace."""


class NamespaceMismatchError(KVStoreError, ValueError):
    """An encoded block belongs to another namespace (model, layout or tenant)."""


class BlockFormatError(KVStoreError, ValueError):
    """Bytes that should hold an encoded block do not (bad magic, version, length...)."""


class ChecksumError(BlockFormatError):
    """An encoded block's payload does not match its header checksum (corruption)."""


class StoreClosedError(KVStoreError, RuntimeError):
    """An operation on a store or tier after `close()`."""


class ReservationError(KVStoreError, RuntimeError):
    """Committing or aborting a reservation that is unknown, expired or already done."""


class LeaseError(KVStoreError, RuntimeError):
    """A lease (or a block in it) that is not held: unknown, ended, or read already."""


class TierIOError(KVStoreError):
    """A tier could not read or write its storage (disk full, I/O error, a damaged index).
    The store turns it into a miss (reads) or NO_SPACE (writes); it never means wrong KV."""
