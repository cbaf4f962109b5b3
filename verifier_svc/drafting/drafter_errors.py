"""Drafter failures, counted per replica and kind, and logged at a bounded rate.

A drafter that fails costs speed, never correctness, so the engine goes on and only the
operator needs to know. Every failure is counted, whether or not metrics are served
(Prometheus exports the counts as `specdec:drafter_errors_total{replica,kind}`). The log
gets at most one line per replica and kind per `interval_s`, saying how many like it were
held back since the previous one, so a flapping or slow drafter cannot flood it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The kinds counted; a label value of the metric.
TIMEOUT = "timeout"            # a step's proposals missed the draft deadline
UNAVAILABLE = "unavailable"    # no stream could be opened (connect, GetInfo)
STREAM_ERROR = "stream_error"  # an open Propose stream broke, ended or stopped answering
BAD_RESPONSE = "bad_response"  # a draft was dropped as malformed
REFUSED = "refused"            # the drafter serves another model (vocabulary, tokenizer)

LOG_INTERVAL_S = 10.0


class DrafterErrors:
    """Counts of drafter failures by (replica address, kind), and their rate-limited log."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self.counts: dict[tuple[str, str], int] = {}
        self._last_logged: dict[tuple[str, str], float] = {}
        self._held_back: dict[tuple[str, str], int] = {}

    def record(self, replica: str, kind: str, text: str, level: int = logging.WARNING) -> None:
        """Counts one failure; logs `text` unless this replica and kind logged less than
        `interval_s` ago. A DEBUG record is counted and logged at DEBUG, outside the limit
        (repeats the caller already knows to be quiet, e.g. a drafter still down)."""
        key = (replica, kind)
        self.counts[key] = self.counts.get(key, 0) + 1
        if level <= logging.DEBUG:
            logger.debug("drafter %s: %s", replica, text)
            return
        now = self._clock()
        last = self._last_logged.get(key)
        if last is not None and now - last < self.interval_s:
            self._held_back[key] = self._held_back.get(key, 0) + 1
            return
        held_back = self._held_back.pop(key, 0)
        self._last_logged[key] = now
        suffix = (f" ({held_back} more {kind} errors in the last {now - last:.0f} s not logged)"
                  if held_back and last is not None else "")
        logger.log(level, "drafter %s: %s%s", replica, text, suffix)

    def forget(self, replica: str) -> None:
        """Drops a replica that left (DNS): its series end, the memory stays bounded."""
        for table in (self.counts, self._last_logged, self._held_back):
            for key in [key for key in table if key[0] == replica]:
                del table[key]
