"""Log lines for events that may come hundreds of times a second (a full disk met by every
put, a client rewriting its own put ring): one line per period at most, what came between
counted, so a log says how much happened without being flooded by it."""
from __future__ import annotations

import math
import time


class LogEvery:
    def __init__(self, period_s: float = 10.0) -> None:
        self.period_s = period_s
        self._at = -math.inf  # when the last line was due
        self._skipped = 0  # events since, not logged

    def due(self) -> int | None:
        """Count one event. None: not logged (the last line is recent); else log it now:
        the number of events since the last line, not logged (this one not counted)."""
        now = time.monotonic()
        if now - self._at < self.period_s:
            self._skipped += 1
            return None
        skipped, self._at, self._skipped = self._skipped, now, 0
        return skipped
