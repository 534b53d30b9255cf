"""SSD tier: RocksDB (rocksdict) under a data directory, one value per block.

Key: the 16-byte block hash. Value: the encoded block (64-byte header with namespace, shape
and an xxh3_64 checksum, then the payload), so every read is verified and a corrupted value
becomes a miss instead of wrong KV. Writes of a batch go in one WriteBatch. When durable
(the default) they go through the write-ahead log, so a block whose `write_n` returned
survives a crash of the process; without the WAL puts are ~2.5x faster but blocks still in
the memtable at a crash are lost (never corrupted; `close` flushes them). Slots are capacity
accounting only; on open every stored block is found again and given a slot.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch
from rocksdict import DBCompressionType, Options, Rdict, WriteBatch, WriteOptions

from kvstore.errors import BlockFormatError, StoreClosedError
from kvstore.events import TierKind
from kvstore.keys import HASH_BYTES, Namespace
from kvstore.layout import checksum, decode_block, encode_header
from kvstore.tiers.base import ByteBatch, FreeSlots
from transfer.copy import copy_bytes


def rocksdb_options() -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_compression_type(DBCompressionType.none())  # KV payloads barely compress
    opts.set_write_buffer_size(128 << 20)  # fewer memtable flush stalls under big batches
    opts.set_max_write_buffer_number(3)
    opts.increase_parallelism(max(2, os.cpu_count() or 2))
    return opts


class SsdTier:
    kind = TierKind.SSD
    persistent = True

    def __init__(self, ns: Namespace, path: str, num_slots: int, durable: bool = True) -> None:
        os.makedirs(path, exist_ok=True)
        self.ns, self.path, self.durable = ns, path, durable
        self.num_slots, self.slot_bytes = num_slots, ns.block_bytes
        self._db: Rdict | None = Rdict(path, options=rocksdb_options())
        if not durable:
            opts = WriteOptions()
            opts.disable_wal = True
            self._db.set_write_options(opts)
        self._free = FreeSlots(num_slots)
        self.num_dropped_at_open = 0

    def _open_db(self) -> Rdict:
        if self._db is None:
            raise StoreClosedError(f"SSD tier at {self.path} is closed")
        return self._db

    def num_free(self) -> int:
        return len(self._free)

    def alloc_n(self, n: int) -> list[int] | None:
        self._open_db()
        return self._free.take(n)

    def free_n(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        db = self._open_db()
        batch = WriteBatch(raw_mode=True)
        for h in hashes:
            batch.delete(bytes(h))
        db.write(batch)
        self._free.give_back(slots)

    def publish_n(self, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        pass  # readers on this host reach SSD blocks through the daemon only

    def write_n(self, slots: Sequence[int], hashes: Sequence[bytes], srcs: ByteBatch) -> None:
        db = self._open_db()
        batch = WriteBatch(raw_mode=True)
        for h, src in zip(hashes, srcs):
            payload = memoryview(src.cpu().numpy())
            batch.put(bytes(h), b"".join((encode_header(self.ns, h, checksum(payload)), payload)))
        db.write(batch)

    def read_n(self, slots: Sequence[int], hashes: Sequence[bytes], dsts: ByteBatch) -> list[bool]:
        db = self._open_db()
        values = db.get([bytes(h) for h in hashes])
        ok = []
        for h, value, dst in zip(hashes, values, dsts):
            if value is None:
                ok.append(False)
                continue
            try:
                _, payload = decode_block(self.ns, value, expect_hash=h)
            except BlockFormatError:  # includes ChecksumError and NamespaceMismatchError
                ok.append(False)
                continue
            _copy_into(dst, payload)
            ok.append(True)
        return ok

    def recover(self) -> list[tuple[bytes, int]]:
        """Give every stored block a slot; blocks beyond capacity or with foreign keys go."""
        db = self._open_db()
        found, extra = [], []
        for key in db.keys():
            slot = self._free.take_one() if len(key) == HASH_BYTES else None
            if slot is not None:
                found.append((key, slot))
            else:
                extra.append(key)
        if extra:
            batch = WriteBatch(raw_mode=True)
            for key in extra:
                batch.delete(key)
            db.write(batch)
        self.num_dropped_at_open = len(extra)
        return found

    def raw_db(self) -> Rdict:
        """The underlying RocksDB handle (for tools and fault-injection tests)."""
        return self._open_db()

    def close(self) -> None:
        if self._db is not None:
            if not self.durable:
                self._db.flush()
            self._db.close()
            self._db = None


def _copy_into(dst: torch.Tensor, payload: memoryview) -> None:
    copy_bytes(dst, np.frombuffer(payload, np.uint8))
