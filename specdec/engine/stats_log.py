"""The engine's periodic log line: speculation's acceptance, the batch and the KV pool."""

from __future__ import annotations

import logging
import time

from specdec.engine.scheduler import Scheduler
from specdec.engine.speculation import Speculation

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0


class StatsLog:
    """Logs the line at most every `interval_s`, once something was drafted."""

    def __init__(self, interval_s: float = STATS_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_logged = time.monotonic()

    def maybe_log(self, speculation: Speculation, scheduler: Scheduler) -> None:
        now = time.monotonic()
        spec = speculation.counters
        if now - self._last_logged < self.interval_s or spec.num_drafts == 0:
            return
        self._last_logged = now
        num_running = len(scheduler.running)
        per_position = ", ".join(f"{n / spec.num_drafts:.2f}" for n in spec.accepted_per_position)
        logger.info(
            "speculation: acceptance rate %.3f, mean acceptance length %.2f, per-position "
            "acceptance [%s], drafts %d; running %d, waiting %d, KV usage %.1f%%%s",
            spec.num_accepted_tokens / max(1, spec.num_draft_tokens),
            1 + spec.num_accepted_tokens / spec.num_drafts, per_position, spec.num_drafts,
            num_running, len(scheduler.waiting), 100 * scheduler.block_manager.usage,
            speculation.realized_summary(num_running))
