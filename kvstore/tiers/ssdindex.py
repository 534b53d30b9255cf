"""The SSD tier's index: RocksDB (rocksdict) mapping block hash -> (slot, checksum).

Only these 32-byte entries live in RocksDB; payloads live in the slab file, written before
their entry. The index is a cache of what the slab file's headers say, which is what makes
it safe to lose:
- at open, an index that RocksDB cannot open or iterate to the end (a corrupted SST, a
  damaged MANIFEST) is set aside (renamed, never deleted) and rebuilt from the slab headers;
- while running, a write RocksDB refuses (disk full, a background error) fails that call
  only; the next call after RETRY_S reopens the database, and if it will not open cleanly,
  writes a fresh one from the tier's own table of what it holds.

Index writes are grouped: `put_n` (after a block's payload and header are written) and
`forget_n` (under the store's lock, when a slot is freed) only queue their entries and
deletes, in order; the `put_n` that makes GROUP_OPS writes them all in one RocksDB write,
outside the store's lock, as does the store's maintenance pass (`persist_frees`), so what
waits is written within a pass even with no put behind it. A put does not
wait for the index: the slab headers already record it, and every open adopts the intact
headers of slots the index does not cover (kvstore.tiers.ssd), so a put acknowledged and
killed before its entry was written is found at the next open all the same. One index write
in the put path cost 12-65 us a put (the WAL's write beside the payload's), a tenth of a
1 MiB SSD put. An explicit remove writes everything queued at once, after the lock
(`flush`), and zeroes the headers first, so a removed block stays removed after a crash.
An eviction's delete not yet written when the process dies leaves a stale entry, which the
next open drops (its slot holds another block's header, or none) or keeps (the slot still
holds that very block, intact: a valid block, not wrong KV).
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import shutil
import struct
import threading
import time
from typing import Callable, Iterable

from rocksdict import DBCompressionType, Options, Rdict, WriteBatch, WriteOptions

from kvstore.errors import TierIOError
from kvstore.keys import HASH_BYTES
from kvstore.logevery import LogEvery

log = logging.getLogger("kvtier.ssd")
ENTRY = struct.Struct("<QQ")  # slot, payload checksum
RETRY_S = 1.0
WARN_EVERY_S = 10.0  # a failing index is logged at most this often
GROUP_OPS = 256  # entries and deletes queued before one RocksDB write takes them all
QUEUE_KEEP = 1024 * GROUP_OPS  # while the index refuses writes, at most this many wait: the
# oldest are let go (a stale entry is harmless, a missing one is adopted from its header at
# open: see above), so memory stays bounded
DELETE = -1  # the slot of a queued delete


def rocksdb_options() -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_compression_type(DBCompressionType.none())  # 32-byte entries: nothing to gain
    opts.set_paranoid_checks(True)
    # RocksDB preallocates its WAL at ~1.1x the write buffer and its MANIFEST at 4 MiB: on
    # a nearly full disk that alone fails writes. The index is small; so are these.
    opts.set_write_buffer_size(64 << 10)  # ~2,000 entries: a flush per ~1 GB of 512 KiB blocks
    opts.set_manifest_preallocation_size(64 << 10)
    # Its info log rolls at every open and kept 1000 old ones (~50 KiB each, the options
    # dump): a full disk's restarts ate the index's headroom until it could not open.
    opts.set_keep_log_file_num(1)
    opts.set_max_log_file_size(256 << 10)
    return opts


class SlotIndex:
    def __init__(self, path: str, durable: bool,
                 entries: Callable[[], Iterable[tuple[bytes, int, int]]]) -> None:
        """`entries`: what the tier holds now, (hash, slot, checksum); a rebuild writes it."""
        self.path, self.durable, self._entries = path, durable, entries
        self._db: Rdict | None = None
        self._queue: collections.deque[tuple[bytes, int, int]] = collections.deque(
            maxlen=QUEUE_KEEP)  # (hash, slot or DELETE, checksum), in the order they came
        self._write_lock = threading.Lock()  # takes the queue and writes it, one at a time
        self._failed_at: float | None = None
        self._refusals = LogEvery(WARN_EVERY_S)  # writes refused (see write_queued)
        self._reopen_failures = LogEvery(WARN_EVERY_S)  # failed reopens (see _recover)
        self.num_errors = 0        # writes or deletes RocksDB refused
        self.num_rebuilds = 0      # times the index was set aside and written afresh
        self.damaged = False       # the last open found it unreadable (recovery rebuilds)

    # ----------------------------------------------------------------- open / load

    def open(self) -> list[tuple[bytes, bytes]]:
        """Open the index and read every entry. On corruption the entries read before it
        are returned with `damaged` set: the caller rebuilds from the slab headers."""
        self.damaged = False
        try:
            if os.path.lexists(self.path) and not os.path.isdir(self.path):
                raise NotADirectoryError(f"{self.path} is not a directory")
            self._db = self._open_db()
            return self._scan()
        except Exception as e:  # noqa: BLE001 - RocksDB raises plain Exceptions
            if _no_space(e):  # (RocksDB writes at every open): the slab headers say what
                self.close()  # the tier holds; the index is written once there is room
                self._failed_at = time.monotonic()
                log.warning("the SSD index %s cannot open for want of disk space (%s): the "
                            "tier serves the blocks its slab headers show, and writes the "
                            "index once the disk has room", self.path, e)
                return []
            if not (_damage(e) or isinstance(e, NotADirectoryError)):
                self.close()  # e.g. out of descriptors, its lock held: not the index's fault
                raise TierIOError(f"cannot open the SSD index {self.path}: {e}") from e
            self.damaged = True
            log.error("SSD index %s is damaged (%s): setting it aside and rebuilding it from "
                      "the slab file", self.path, e)
            self._set_aside()
            self._db = self._open_db()
            return []

    def _open_db(self) -> Rdict:
        db = Rdict(self.path, options=rocksdb_options())
        if not self.durable:
            opts = WriteOptions()
            opts.disable_wal = True
            db.set_write_options(opts)
        return db

    def _scan(self) -> list[tuple[bytes, bytes]]:
        it = self._db.iter()
        try:
            it.seek_to_first()
            out = []
            while it.valid():
                out.append((it.key(), it.value()))
                it.next()
            it.status()  # raises if the iteration stopped on an error, not at the end
            return out
        finally:
            del it  # an iterator keeps the database (and its LOCK) open past close()

    def _set_aside(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            except Exception:  # noqa: BLE001 - it is being discarded
                pass
            self._db = None
        if os.path.exists(self.path):
            stamp = time.strftime('%Y%m%d-%H%M%S')
            aside = next(p for p in (f"{self.path}.damaged-{stamp}-{i}" for i in range(1000))
                         if not os.path.exists(p))
            os.rename(self.path, aside)
            log.error("the damaged SSD index is kept at %s for inspection", aside)

    # ----------------------------------------------------------------- writes

    def put_n(self, hashes, slots, sums) -> None:
        """Index blocks whose payloads and headers are written: queued, and written with
        the rest once GROUP_OPS wait. Never raises (a refused write is logged; its entries
        wait for the next one, and the open after a crash adopts them from the headers)."""
        self.queue_n(hashes, slots, sums)
        self.write_if_due()

    def write_if_due(self) -> None:
        """Write what is queued once GROUP_OPS wait (outside the store's lock)."""
        if len(self._queue) >= GROUP_OPS:
            self.write_queued()

    def queue_n(self, hashes, slots, sums) -> None:
        """`put_n`'s entries, queued only (under the store's lock: never touches RocksDB)."""
        self._queue.extend(zip(map(bytes, hashes), slots, sums))

    def forget_n(self, hashes) -> None:
        """Queue deletes, written with the next group (called under the store's lock: it
        never touches RocksDB, never raises)."""
        self._queue.extend((bytes(h), DELETE, 0) for h in hashes)

    def flush(self) -> None:
        """Write everything queued now, in order, in one RocksDB write; TierIOError if
        RocksDB refuses (the queue then waits for the next write)."""
        with self._write_lock:
            ops = [self._queue.popleft() for _ in range(len(self._queue))]
            if not ops:
                return
            try:
                self._write(_batch(ops))
            except TierIOError:
                self._queue.extendleft(reversed(ops))
                raise

    def write_queued(self) -> None:
        """`flush`, a refusal logged: the queue waits for the next write (a delete not
        written leaves a stale entry, an entry not written is adopted from its header at
        the next open: see above)."""
        try:
            self.flush()
        except TierIOError as e:  # logged once per WARN_EVERY_S: on a full disk every put
            unlogged = self._refusals.due()  # that fills a group meets it, hundreds a second
            if unlogged is None:
                return
            more = f"; {unlogged} more like it since the last" if unlogged else ""
            log.warning("%s (the queued entries wait; the slab headers hold them%s)", e, more)

    def delete_n(self, hashes) -> None:
        """Delete entries now (with anything queued); TierIOError if RocksDB refuses."""
        self._queue.extend((bytes(h), DELETE, 0) for h in hashes)
        self.flush()

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def _write(self, batch: WriteBatch) -> None:
        if self._failed_at is not None:
            if time.monotonic() - self._failed_at < RETRY_S:
                raise TierIOError(f"the SSD index {self.path} is failing; retrying shortly")
            self._recover()
        try:
            self._db.write(batch)
        except Exception as e:  # noqa: BLE001 - RocksDB raises plain Exceptions
            self._failed_at = time.monotonic()
            self.num_errors += 1
            raise TierIOError(f"the SSD index {self.path} refused a write: {e}") from e

    def _recover(self) -> None:
        """Reopen after a failure; a database that will not reopen cleanly is set aside and
        written afresh from the tier's table."""
        self._failed_at = None
        try:
            if self._db is not None:
                db, self._db = self._db, None
                db.close()
            self._db = self._open_db()
            self._scan()
            log.warning("SSD index %s reopened after an error", self.path)
            return
        except Exception as e:  # noqa: BLE001
            # (on a full disk this comes every RETRY_S: logged once per WARN_EVERY_S)
            if self._reopen_failures.due() is not None:
                log.error("SSD index %s does not reopen cleanly (%s): rebuilding it",
                          self.path, e)
        try:
            self.rebuild(self._entries())
        except Exception as e:  # noqa: BLE001
            self._failed_at = time.monotonic()
            raise TierIOError(f"the SSD index {self.path} cannot be rebuilt: {e}") from e

    def rebuild(self, entries: Iterable[tuple[bytes, int, int]]) -> None:
        """Write `entries` into a fresh index, then put it in the current one's place (set
        aside). Built beside it first: on a full disk the build fails and the current index
        stays where it is, the one the next open reads (setting it aside first left an empty
        directory there, and every block acknowledged before was lost at the next open)."""
        tmp = self.path + ".new"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            db = Rdict(tmp, options=rocksdb_options())
            try:
                db.write(_batch(entries))
                db.flush()
            finally:
                db.close()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._queue.clear()  # the fresh index holds only `entries`
        self._set_aside()
        os.rename(tmp, self.path)
        self._db = self._open_db()
        self.num_rebuilds += 1

    # ----------------------------------------------------------------- life

    @property
    def db(self) -> Rdict:
        return self._db

    def close(self) -> None:
        if self._db is None:
            return
        if self._queue:
            self.write_queued()
        try:
            if not self.durable:
                self._db.flush()
            self._db.close()
        except Exception as e:  # noqa: BLE001 - a full disk at shutdown: the WAL holds it
            log.error("closing the SSD index %s: %s (its write-ahead log keeps what was "
                      "acknowledged)", self.path, e)
        self._db = None


def _batch(ops: Iterable[tuple[bytes, int, int]]) -> WriteBatch:
    """One RocksDB write of (hash, slot or DELETE, checksum), applied in order: the queue,
    or a rebuild's entries (none of them a delete)."""
    batch = WriteBatch(raw_mode=True)
    for h, slot, c in ops:
        if slot == DELETE:
            batch.delete(bytes(h))
        else:
            batch.put(bytes(h), ENTRY.pack(slot, c))
    return batch


def parse_entry(key: bytes, value: bytes) -> tuple[bytes, int, int] | None:
    """(hash, slot, checksum) of an index entry, or None when it is not one."""
    if len(key) != HASH_BYTES or len(value) != ENTRY.size:
        return None
    slot, c = ENTRY.unpack(value)
    return key, slot, c


def _no_space(e: Exception) -> bool:
    """Whether an error says the disk (or the user's quota) is full."""
    return (getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
            or "No space left on device" in str(e) or "Disk quota exceeded" in str(e))


def _damage(e: Exception) -> bool:
    """Whether RocksDB's error says the index itself is broken (a corrupted file, or one of
    its files gone: a MANIFEST deleted reads "IO error: No such file"), which a rebuild
    from the slab headers mends, rather than something a retry may see pass."""
    text = str(e)
    return "Corruption" in text or "No such file or directory" in text
