"""A dependency-free progress line for long training phases (stderr, throttled)."""

from __future__ import annotations

import sys
import time


class Progress:
    """`name  done/total unit  rate  eta  extra`, redrawn at most every `interval_s` seconds.

    On a terminal the line is redrawn in place; in a log file each redraw is a new line.
    """

    def __init__(self, name: str, total: int | None, unit: str = "it", interval_s: float = 2.0) -> None:
        self.name, self.total, self.unit, self.interval_s = name, total, unit, interval_s
        self.done = 0
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._sums: dict[str, float] = {}
        self._tty = sys.stderr.isatty()

    def update(self, count: int = 1, **values: float) -> None:
        """Advances by `count`; numeric `values` are summed (shown as totals) unless given to `show`."""
        self.done += count
        for key, value in values.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
        now = time.monotonic()
        if now - self._last_draw >= self.interval_s:
            self._last_draw = now
            self._draw()

    def show(self, **values: float | str) -> None:
        """Sets values shown as they are (loss, lr), replacing earlier ones."""
        for key, value in values.items():
            self._sums[key] = value  # type: ignore[assignment]

    def _draw(self) -> None:
        elapsed = time.monotonic() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        total = f"/{self.total}" if self.total else ""
        eta = ""
        if self.total and rate > 0:
            eta = f" eta {(self.total - self.done) / rate / 60:.1f} min"
        extra = " ".join(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                         for key, value in self._sums.items())
        line = (f"{self.name} {self.done}{total} {self.unit} {rate:.2f}/s "
                f"{elapsed / 60:.1f} min{eta} {extra}")
        sys.stderr.write(("\r" + line + "\x1b[K") if self._tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        self._draw()
        if self._tty:
            sys.stderr.write("\n")
