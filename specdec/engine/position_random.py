"""`PositionRandom`: a seeded request's random stream, one generator per output position.

A seeded request must emit the same tokens whatever else the server does: the load, the
batch it lands in, the cache state, whether speculation is on and how many drafts a step
verified. So no draw depends on the step: output position p's draws come from a generator
seeded by (seed, p, purpose) alone, where purpose tells apart a position's two kinds of
draw (the token sampled there; the uniform that accepts or rejects a probabilistic draft).
A request retried elsewhere, or resumed after output tokens it already has, draws what it
would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
# The draws at a position: the token sampled there, and the acceptance test of a draft.
SAMPLE, ACCEPT = 0, 1


def _mix64(value: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


@dataclass(frozen=True, slots=True)
class PositionRandom:
    """The draws of a seeded request from output position `first_position` on (a verify
    step's row 0: the number of output tokens before it)."""

    seed: int
    first_position: int = 0

    def starting_at(self, first_position: int) -> PositionRandom:
        return PositionRandom(self.seed, first_position)

    def generator(self, row: int, purpose: int = SAMPLE) -> torch.Generator:
        """A CPU generator for row `row` of the step (output position first_position + row)."""
        position = self.first_position + row
        mixed = _mix64(_mix64(_mix64(self.seed & _MASK64) ^ position) ^ purpose)
        return torch.Generator().manual_seed(mixed)
