"""vLLM's `num_speculative_tokens_per_batch_size`: the most draft tokens per request a step
may verify, by the size of its running batch.

The table is a list of `[min_batch_size, max_batch_size, k]` rows (inclusive bounds, rows
not overlapping); a batch size no row covers keeps `num_speculative_tokens`. specdec's
adaptive policy treats each row as a cap (it may still draft fewer), the fixed policy
drafts exactly that many.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.errors import ConfigError

FIELD = "num_speculative_tokens_per_batch_size"


@dataclass(frozen=True)
class DraftCaps:
    rows: tuple[tuple[int, int, int], ...]

    @classmethod
    def parse(cls, value: Any, num_speculative_tokens: int) -> DraftCaps | None:
        """The field's value checked (errors name the field and the row); None: absent."""
        if value is None:
            return None
        if not isinstance(value, list) or not value:
            raise ConfigError(f"speculative config: {FIELD} must be a non-empty list of "
                              f"[min_batch_size, max_batch_size, k] rows, got {value!r}",
                              param=FIELD)
        rows: list[tuple[int, int, int]] = []
        for index, row in enumerate(value):
            if (not isinstance(row, list) or len(row) != 3
                    or any(isinstance(x, bool) or not isinstance(x, int) for x in row)):
                raise ConfigError(f"speculative config: {FIELD}[{index}] must be three "
                                  f"integers [min_batch_size, max_batch_size, k], got {row!r}",
                                  param=FIELD)
            low, high, k = row
            if not 1 <= low <= high:
                raise ConfigError(f"speculative config: {FIELD}[{index}] needs 1 <= "
                                  f"min_batch_size <= max_batch_size, got {row!r}", param=FIELD)
            if not 0 <= k <= num_speculative_tokens:
                raise ConfigError(f"speculative config: {FIELD}[{index}]: k must be in 0.."
                                  f"{num_speculative_tokens} (num_speculative_tokens), got {k}",
                                  param=FIELD)
            rows.append((low, high, k))
        rows.sort()
        for (_, high, _), (low, _, _) in zip(rows, rows[1:]):
            if low <= high:
                raise ConfigError(f"speculative config: {FIELD} rows overlap at batch size "
                                  f"{low}", param=FIELD)
        return cls(tuple(rows))

    def cap(self, num_seqs: int, num_speculative_tokens: int) -> int:
        """The most draft tokens per request in a step of `num_seqs` running requests."""
        for low, high, k in self.rows:
            if low <= num_seqs <= high:
                return k
        return num_speculative_tokens

    def to_json(self) -> list[list[int]]:
        return [list(row) for row in self.rows]
