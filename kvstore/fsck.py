"""Offline verification of an SSD tier directory (`kvtier fsck`).

Every index entry must point at a slot of the slab file holding that very block, intact
(header: hash, namespace; payload: checksum). An index RocksDB cannot read to the end is
itself a finding: the blocks it lost are counted from the slab headers. Intact blocks the
index does not list yet (their entries were queued when the tier was killed) are counted,
not faulted: the tier adopts them at its next open; such a block whose payload fails its
checksum is a finding (damage: a header is written after its payload), as is a slab file
missing beside its headers. The check opens everything read-only and creates nothing.
`repair` drops the bad entries and blocks and, for a damaged index, rebuilds it from the
slab file (what the tier does on its own at open), so nothing intact is lost.
"""
from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np
from rocksdict import AccessType, Rdict

from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.tiers.slabfile import (HEADERS, SLABS, SlabFile, headers_missing, old_layout,
                                    stride_of)
from kvstore.tiers.ssd import TIER_FILE, SsdTier, damaged_copy
from kvstore.tiers.ssdindex import parse_entry, rocksdb_options


class FsckReport(NamedTuple):
    num_ok: int
    num_bytes: int
    bad: list[tuple[bytes, str]]   # (key, reason) of every entry that fails
    index_error: str | None        # why the index could not be read to the end
    num_recoverable: int           # intact blocks in the slab file the index does not list
    # (lost with a damaged index, or queued when the tier stopped: adopted at its next open)

    @property
    def clean(self) -> bool:
        return not self.bad and self.index_error is None


def fsck(path: str, repair: bool = False) -> FsckReport:
    ns = _namespace(path)
    report = _check(path, ns)
    if repair and not report.clean:
        _repair(path, ns)
    return report


def _kind(path: str) -> str:
    if os.path.islink(path):
        return "a link to nothing" if not os.path.exists(path) else "a link"
    return "a directory" if os.path.isdir(path) else "not a file"


def _namespace(path: str) -> Namespace:
    meta = os.path.join(path, TIER_FILE)
    if not os.path.isfile(meta):
        raise ConfigError(f"{path} is not an SSD tier directory (no {TIER_FILE})")
    try:
        with open(meta) as f:
            ns = Namespace(**json.load(f))
    except (OSError, ValueError, TypeError) as e:  # unreadable, not JSON, not a namespace
        raise ConfigError(f"{meta} does not name a namespace ({e}): the tier rewrites it at "
                          "its next open; fsck cannot check the blocks without it") from e
    if old_layout(path, ns):
        raise ConfigError(f"{path} is an SSD tier of an older layout (headers inside slabs.dat): "
                          "the daemon moves it aside and starts it empty at its next start; "
                          "there is nothing to check or repair in place")
    return ns


def _check(path: str, ns: Namespace) -> FsckReport:
    for name in (SLABS, HEADERS):
        p = os.path.join(path, name)
        if os.path.lexists(p) and not os.path.isfile(p):  # (a directory had been said to
            raise ConfigError(  # be missing, while the tier refused to open: EISDIR)
                f"{p} is not a regular file ({_kind(p)}): the tier cannot open the "
                f"directory; move {name} aside (the blocks it held are lost) and restart")
    if headers_missing(path):  # (a SlabFile would create an empty one)
        entries, index_error = _read_index(os.path.join(path, "index"))
        return FsckReport(0, 0, [], f"{HEADERS} is missing; the tier writes it again from the "
                          f"index ({len(entries)} entries) at its next open, or --repair does "
                          f"now" + (f" ({index_error})" if index_error else ""), 0)
    missing = [name for name in (SLABS, HEADERS) if not os.path.isfile(os.path.join(path, name))]
    if missing:  # (with headers.dat alone missing, headers_missing said so above)
        entries, index_error = _read_index(os.path.join(path, "index"))
        bad = [(key, f"{' and '.join(missing)} missing: the block is gone")
               for key, _ in entries]
        lost = None  # (slabs.dat gone beside headers: blocks lost; neither: never written)
        if missing == [SLABS] and os.path.getsize(os.path.join(path, HEADERS)):
            lost = (f"{SLABS} is missing: every block it held is lost (the tier finds none "
                    "of them at its next open)")
        return FsckReport(0, 0, bad, lost or index_error, 0)
    slabs = SlabFile(path, ns, 1 << 62, readonly=True)
    try:
        entries, index_error = _read_index(os.path.join(path, "index"))
        ok, bad, claimed = 0, [], set()
        named: dict[int, set[bytes]] = {}  # slot -> the hashes entries put there
        for e in filter(None, (parse_entry(k, v) for k, v in entries)):
            named.setdefault(e[1], set()).add(e[0])
        for key, value in entries:
            reason = _entry_problem(slabs, key, value, claimed, named)
            if reason:
                bad.append((key, reason))
            else:
                ok += 1
        recoverable, damaged = _unlisted(slabs, claimed, named)
        return FsckReport(ok, ok * ns.block_bytes, bad + damaged, index_error, recoverable)
    finally:
        slabs.close()


def _unlisted(slabs: SlabFile, claimed: set, named: dict[int, set[bytes]]
              ) -> tuple[int, list[tuple[bytes, str]]]:
    """Slots holding a header that no index entry names: (how many hold their block
    intact, the others as (hash, reason)). The intact ones are blocks the index lost, or
    whose entries were still queued when the tier stopped without closing: the tier adopts
    them at its next open. A header is written after its payload, so one whose payload
    fails its checksum is damage (the tier finds it a miss, and drops it, when read)."""
    free = [s for s in range(slabs.num_grown) if s not in claimed]
    dst = memoryview(np.empty(slabs.block_bytes, np.uint8))
    intact, damaged = 0, []
    for slot, h, c in slabs.headers(free, unreadable_as_none=True):
        if h is None or h in named.get(slot, ()):  # (that entry's verdict stands)
            continue
        if slabs.read_n([slot], [c], [dst])[0]:
            intact += 1
        else:
            damaged.append((h, f"slot {slot} (no index entry yet) does not hold its block "
                               "intact: its payload fails the checksum its header gives"))
    return intact, damaged


def _read_index(path: str) -> tuple[list[tuple[bytes, bytes]], str | None]:
    """Every entry of the index, read-only (a check writes nothing: opened read-write, a
    missing index was created empty, which the tier then took for the real one)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        return [], ("the index's path is not a directory (the tier sets it aside and "
                    "rebuilds the index from the slab file)")
    if not os.path.isfile(os.path.join(path, "CURRENT")):
        return [], "the index is missing (the tier rebuilds it from the slab file)"
    try:
        db = Rdict(path, options=rocksdb_options(), access_type=AccessType.read_only())
    except Exception as e:  # noqa: BLE001 - RocksDB's own words
        return [], f"the index cannot be opened: {e}"
    entries, error = [], None
    try:
        it = db.iter()
        it.seek_to_first()
        while it.valid():
            entries.append((it.key(), it.value()))
            it.next()
        it.status()
    except Exception as e:  # noqa: BLE001
        error = f"the index is damaged after {len(entries)} entries: {e}"
    finally:
        db.close()
    return entries, error


def _entry_problem(slabs: SlabFile, key: bytes, value: bytes, claimed: set,
                   named: dict[int, set[bytes]]) -> str | None:
    entry = parse_entry(key, value)
    if entry is None:
        return "not an index entry (wrong key or value size)"
    h, slot, want = entry
    if slot >= slabs.num_grown:
        return (f"slot {slot} is beyond the slab files ({SLABS} and {HEADERS} both back "
                f"{slabs.num_grown} slots)")
    # before the claim: a stale entry (a delete a crash cut off) naming the same slot as the
    # block now in it takes nothing from it
    ((_, holder, c),) = slabs.headers([slot], unreadable_as_none=True)
    if (holder is not None and holder not in named[slot] and c == want
            and damaged_copy(h, holder)):  # the header's hash field damaged (not a block of
        claimed.add(slot)  # its own to adopt)
        return (f"slot {slot}'s header names another block but holds this entry's checksum: "
                "the header is damaged; the next start or --repair writes it again")
    dst = memoryview(np.empty(slabs.block_bytes, np.uint8))
    intact = holder is not None and slabs.read_n([slot], [c], [dst])[0]
    if holder is not None and holder != h:
        if intact:  # the block its header names is there, whole
            return (f"slot {slot} now holds another block: a stale entry (its delete was "
                    "cut off by a crash), harmless; the next start or --repair drops it")
        return (f"slot {slot} holds neither this block nor, intact, the one its header "
                "names (damage)")
    if not intact:
        return f"slot {slot} does not hold this block intact (checksum or header)"
    if slot in claimed:
        return f"slot {slot} is listed twice"
    claimed.add(slot)
    return None


def _repair(path: str, ns: Namespace) -> None:
    """Open the tier (a damaged index is rebuilt from the slabs), then drop every block
    that does not read back intact."""
    tier = SsdTier(ns, path, _grown_slots(path, ns))
    try:
        found = tier.recover()
        row = np.empty((1, ns.block_bytes), np.uint8)
        bad = [(h, s) for h, s in found if not tier.read_n([s], [h], row)[0]]
        if bad:
            tier.free_n([s for _, s in bad], [h for h, _ in bad])
    finally:
        tier.close()


def _grown_slots(path: str, ns: Namespace) -> int:
    """Slots the slab file holds (read from its size: a SlabFile would create a missing
    header file, which the tier then could not tell from a real one)."""
    try:
        return max(1, os.path.getsize(os.path.join(path, SLABS)) // stride_of(ns.block_bytes))
    except OSError:
        return 1
