"""Offline verification of an SSD tier directory: every value must be a valid encoded block
stored under its own hash."""
from __future__ import annotations

import os
from typing import NamedTuple

from rocksdict import Rdict, WriteBatch

from kvstore.errors import BlockFormatError, ConfigError
from kvstore.keys import HASH_BYTES
from kvstore.layout import verify_encoded
from kvstore.tiers.ssd import rocksdb_options


class FsckReport(NamedTuple):
    num_ok: int
    num_bytes: int
    bad: list[tuple[bytes, str]]  # (key, reason)


def fsck(path: str, repair: bool = False) -> FsckReport:
    if not os.path.isfile(os.path.join(path, "CURRENT")):
        raise ConfigError(f"{path} is not an SSD tier directory (no RocksDB CURRENT file)")
    db = Rdict(path, options=rocksdb_options())
    ok, nbytes, bad = 0, 0, []
    try:
        for key, value in db.items():
            reason = _check(key, value)
            if reason:
                bad.append((key, reason))
            else:
                ok += 1
                nbytes += len(value)
        if repair and bad:
            batch = WriteBatch(raw_mode=True)
            for key, _ in bad:
                batch.delete(key)
            db.write(batch)
    finally:
        db.close()
    return FsckReport(ok, nbytes, bad)


def _check(key: bytes, value: bytes) -> str | None:
    if len(key) != HASH_BYTES:
        return f"key of {len(key)} bytes is not a block hash"
    try:
        header = verify_encoded(value)
    except BlockFormatError as e:
        return str(e)
    if header.block_hash != key:
        return f"value holds block {header.block_hash.hex()}"
    return None
