"""What the policy plans over: one sequence that may draft this step, with its cap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Candidate:
    """A sequence the plan may draft for."""

    seq_id: int
    max_tokens: int  # the cap: request override, room left, server k
    # The drafter holds its context already (the engine synced the prompt as its prefill
    # started): its first ask costs a steady round trip, not a first ask's.
    synced: bool = False
