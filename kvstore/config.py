"""Store configuration: frozen, validated at construction."""
from __future__ import annotations

import operator
import os
import re
from dataclasses import dataclass

from kvstore.errors import ConfigError, UnknownTierError
from kvstore.events import TierKind

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def read_text_file(path: str, what: str) -> tuple[list[str], int]:
    """The lines of a small UTF-8 file that holds secrets (`what` names it in the errors),
    and its mode: the caller decides what a mode others may read calls for."""
    try:
        with open(path) as f:
            return list(f), os.fstat(f.fileno()).st_mode
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text ({e})") from e


def parse_size(text: str | int) -> int:
    """'4GiB', '512 MiB', '1.5G', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}: use a number with an optional unit "
                          "such as 512MiB, 4GiB or 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _whole(value) -> int | None:
    """`value` as an int when it is a whole number (numpy's too), else None (bools, floats)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def tier_kind(name: str | TierKind) -> TierKind:
    if isinstance(name, TierKind):
        return name
    try:
        return TierKind[name.upper()]
    except KeyError:
        raise UnknownTierError(f"unknown tier {name!r}: choose from "
                               f"{', '.join(k.name.lower() for k in TierKind)}") from None


@dataclass(frozen=True)
class TierConfig:
    """One tier: its kind, capacity in blocks, and where its memory lives."""

    kind: TierKind
    capacity_blocks: int
    path: str | None = None        # SSD: the RocksDB directory
    device: str | None = None      # GPU: torch device (default cuda when present, else cpu)
    durable: bool = True           # SSD: write-ahead log on, so a block survives a process
                                   # crash; off: ~2.5x faster puts, recent blocks lost on crash
    high_watermark: float = 0.95   # background eviction starts above this fill fraction...
    low_watermark: float = 0.85    # ...and demotes blocks until the fill is at or below this

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", tier_kind(self.kind))
        cap = _whole(self.capacity_blocks)
        if cap is None or cap <= 0:
            raise ConfigError(f"{self.kind.name} tier capacity must be a whole number of blocks, "
                              f"at least one; got {self.capacity_blocks!r}")
        object.__setattr__(self, "capacity_blocks", cap)
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError(f"{self.kind.name} tier watermarks need 0 < low <= high <= 1, got "
                              f"low={self.low_watermark} high={self.high_watermark}")
        if self.kind is TierKind.SSD and not self.path:
            raise ConfigError("the SSD tier needs a path (its RocksDB directory)")


@dataclass(frozen=True)
class StoreConfig:
    """Tiers fastest first (at most one of each kind, SSD last)."""

    tiers: tuple[TierConfig, ...]
    promote_on_hit: bool = True          # a hit in a lower tier moves the block up
    reservation_timeout_s: float = 30.0  # an uncommitted put is reclaimed after this
    node_id: str = "local"               # names this store in its KV events
    event_buffer: int = 65536            # undrained events kept (older ones are lost: a seq gap)
    background_interval_s: float | None = None  # run maintain() on a thread this often

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if not self.tiers:
            raise ConfigError("a store needs at least one tier")
        kinds = [t.kind for t in self.tiers]
        if kinds != sorted(set(kinds)):
            raise ConfigError(f"tiers must be distinct and ordered fastest first (gpu, dram, ssd); "
                              f"got {[k.name.lower() for k in kinds]}")
        if not self.reservation_timeout_s > 0:  # NaN too: nothing would ever be reclaimed
            raise ConfigError(f"reservation_timeout_s must be > 0, got {self.reservation_timeout_s}")
        if self.background_interval_s is not None and not self.background_interval_s > 0:
            raise ConfigError("background_interval_s must be > 0 (or None: no maintenance "
                              f"thread), got {self.background_interval_s}")
        if (_whole(self.event_buffer) or 0) < 1:
            raise ConfigError(f"event_buffer must be a whole number >= 1, got {self.event_buffer!r}")
