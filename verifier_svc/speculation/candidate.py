"""What the policy plans over: one sequence that may draft this step, with its cap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Candidate:
    """A sequence the plan may draft for."""

    seq_id: int
    max_tokens: int  # the cap: request override, room left, server k
