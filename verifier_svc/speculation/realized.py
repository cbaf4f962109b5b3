"""What drafting realized, against plain steps at the same batch size: the policy's check on
its own cost model.

The plan (policy.py) and the evidence cut (evidence.py) price drafts with fitted costs: a
verified row at the fitted slope, the drafter's round trip. Those fits are linear in the
rows and blind to what else a row costs: at 16 agent requests a draft row attends over a
~1,100-token context through the multi-row path, and the fit, dominated by single-token
steps, put it at 1.27 ms where drafting steps took 1.55 ms a row; drafting steps there
yielded 398 tokens/s against 461 for the plain steps between them, and the plan kept
drafting because every prediction said it paid.

So the engine reports every decode step's wall time (schedule, round trip, forward,
sampling) and tokens, with what the fitted cost predicts a plain step of that many sequences
takes. Per batch-size bucket, the plain steps give how far wall time runs over that
prediction (the step's other work), and so what a plain step of any size in the bucket
yields per second; a drafting step is then worth its tokens against the tokens a plain
step of its size would have yielded in its time (a bucket spans 9-16 sequences, and a raw
tokens/s would credit drafting at 16 against plain steps at 9). While drafting steps yield
less than that, the cost of drafting at the bucket (its verified rows, first-draft terms
and round trip) is scaled up, a little per drafting step, so the plan and the evidence cut
keep only the drafts whose gain clears the realized cost; while they yield more, the scale
comes back down to 1 (the fitted cost as it is). Nothing changes until both kinds of step
were seen at the bucket, so a batch that always drafts (one request on repetitive text) is
left to the plan, and the scale is bounded, so the plan's probes still measure acceptance
at the highest scale.

Steps whose only drafts are the plan's probes are left out: a probe goes to a sequence the
plan expects not to pay, to find out whether it has started to, so probe steps yield less
by design; counted, they raised the scale at one request on `rag` until the first 16
requests ran at 1.13-1.16x plain against 1.36x without the check. And since a high scale
stops the very drafting that would lower it, every plain step relaxes the scale toward 1
(RELAX), so drafting is tried again after a few hundred plain steps.
"""

from __future__ import annotations

import math

# Decay of the bucket's sums, per step of their kind.
RATE_DECAY = 0.95
# Steps of each kind a bucket must have seen before its scale moves.
MIN_STEPS = 8
# The scale's log moves by this times the log of (plain-equivalent tokens / tokens), per
# drafting step: a 15% loss that lasts doubles the cost in ~100 drafting steps (~3 s at
# 16 requests here), and one noisy step moves it by under 1%.
GAIN = 0.05
MAX_SCALE = 8.0
# Per plain step, the scale's log is multiplied by this (half-life ~140 plain steps).
RELAX = 0.995


def bucket(num_seqs: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share a bucket (0, 1, 2, 3, 4, ...)."""
    return max(0, num_seqs - 1).bit_length()


class _Bucket:
    __slots__ = ("drafted_tokens", "drafting_steps", "plain_equivalent", "plain_predicted",
                 "plain_seconds", "plain_steps")

    def __init__(self) -> None:
        self.plain_seconds = 0.0     # decayed wall time of plain steps
        self.plain_predicted = 0.0   # what the fitted cost predicted for them
        self.plain_steps = 0
        self.drafted_tokens = 0.0    # decayed tokens of drafting steps
        self.plain_equivalent = 0.0  # what plain steps would have yielded in their time
        self.drafting_steps = 0

    def overrun(self) -> float:
        """Plain steps' wall time over the fitted prediction."""
        return self.plain_seconds / self.plain_predicted


class RealizedThroughput:
    """Per batch-size bucket: what drafting steps yield against plain steps of their size
    in their time, and the scale on drafting's cost that follows."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._log_scale: dict[int, float] = {}

    def observe(self, num_seqs: int, asked: bool, num_tokens: int, seconds: float,
                plain_seconds: float) -> None:
        """A decode step of `num_seqs` sequences that asked the drafter (`asked`) or drafted
        nothing, and yielded `num_tokens` tokens in `seconds` of wall time; `plain_seconds`:
        the fitted cost of a plain step of `num_seqs` sequences."""
        if num_seqs <= 0 or seconds <= 0.0 or plain_seconds <= 0.0:
            return
        key = bucket(num_seqs)
        state = self._buckets.get(key)
        if state is None:
            state = self._buckets[key] = _Bucket()
        if not asked:
            state.plain_seconds = state.plain_seconds * RATE_DECAY + seconds
            state.plain_predicted = state.plain_predicted * RATE_DECAY + plain_seconds
            state.plain_steps += 1
            if key in self._log_scale:
                self._log_scale[key] *= RELAX
            return
        if state.plain_steps < MIN_STEPS:
            return
        # A plain step of this size takes plain_seconds * overrun: in `seconds` it would
        # have yielded num_seqs * seconds / that.
        equivalent = num_seqs * seconds / (plain_seconds * state.overrun())
        state.drafted_tokens = state.drafted_tokens * RATE_DECAY + num_tokens
        state.plain_equivalent = state.plain_equivalent * RATE_DECAY + equivalent
        state.drafting_steps += 1
        if state.drafting_steps < MIN_STEPS or state.drafted_tokens <= 0.0:
            return
        log_scale = (self._log_scale.get(key, 0.0)
                     + GAIN * math.log(state.plain_equivalent / state.drafted_tokens))
        self._log_scale[key] = min(max(log_scale, 0.0), math.log(MAX_SCALE))

    def cost_scale(self, num_seqs: int) -> float:
        """What drafting's fitted cost is multiplied by at this batch size (>= 1)."""
        return math.exp(self._log_scale.get(bucket(num_seqs), 0.0))

    def efficiency(self, num_seqs: int) -> float | None:
        """Drafting steps' tokens over what plain steps would have yielded in their time, at
        this batch size's bucket; None before both kinds were seen."""
        state = self._buckets.get(bucket(num_seqs))
        if state is None or state.drafting_steps == 0 or state.plain_equivalent <= 0.0:
            return None
        return state.drafted_tokens / state.plain_equivalent
