"""The target's hidden states a drafter needs (EAGLE): captured in the verify forward and
kept per sequence for the tokens computed for good, to be sent with its next ask."""

from __future__ import annotations

import torch

from specdec.engine.scheduler import ScheduledSequence
from specdec.engine.sequence import Sequence


def start_capture(scheduled: list[ScheduledSequence], width: int, dtype: torch.dtype) -> None:
    """Gives hidden-state buffers of `width` to sequences whose first forward is this step.

    A sequence that ran before any drafter asked for states never gets a buffer,
    and so is never drafted for: its drafter would lack the states of its prefix.
    """
    for item in scheduled:
        seq = item.seq
        if seq.hidden_states is None and seq.num_computed_tokens == 0:
            capacity = seq.prompt_len + seq.params.max_tokens
            seq.hidden_states = torch.empty(capacity, width, dtype=dtype)


def keep_hidden(seq: Sequence, hidden: torch.Tensor | None, first_row: int, num_valid: int) -> None:
    """Stores the states of the `num_valid` tokens this step computed for good, from the
    step's rows at `first_row` (rejected drafts' rows are left out)."""
    if hidden is None or seq.hidden_states is None:
        return
    start = seq.num_computed_tokens
    seq.hidden_states[start:start + num_valid] = hidden[first_row:first_row + num_valid]
