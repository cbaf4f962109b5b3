"""Drafts priced by their own evidence: how much of each arrived draft a step verifies.

The plan (policy.py) decides whom to ask before any draft exists, from past acceptance. A
text-matching drafter (ngram, suffix) then sends, per draft token, a confidence from the
match it copied (drafter_svc/confidence.py: the match length and how often the matched
text went on this way). That ranks evidence but is not a probability, so it is
*calibrated* here: decayed counts, per confidence bin, of how often a token with that
confidence was accepted once every token before it was (the same conditional acceptance
the plan estimates per position), with the confidence itself as the prior of an unseen bin.

With calibrated rates a_1, a_2, ... a draft's token j adds an expected p_j = a_1 * ... *
a_j tokens and costs one more verified row. `verified_lengths` takes every draft of the
step and adds tokens greedily, the largest p_j first, while p_j * T > dT * G (T the step's
predicted seconds with the round trip already paid, G its expected tokens): the prefix
of each draft that maximises the step's expected tokens per second at the fitted cost of
this batch. A long, consistent match verifies to the draft cap; a weak one verifies little
or nothing; a sequence whose earlier drafts failed but whose text just became repetitive
verifies its whole strong draft at once instead of growing back one position a step.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

# Bins over [0, 1]; the confidences the drafters send cluster near 1 (long, consistent
# matches: 0.9-1.0) and spread below, so the top of the range is binned finer.
BIN_EDGES = (0.2, 0.4, 0.6, 0.75, 0.85, 0.92, 0.96, 0.985)
CALIBRATION_DECAY = 0.998
# The weight, in draft tokens, of a bin's prior (its confidence) against what it measured.
PRIOR_WEIGHT = 4.0


def _bin(confidence: float) -> int:
    for index, edge in enumerate(BIN_EDGES):
        if confidence < edge:
            return index
    return len(BIN_EDGES)


class ConfidenceCalibration:
    """The acceptance that a draft token of a given confidence achieved, engine-wide."""

    def __init__(self) -> None:
        num_bins = len(BIN_EDGES) + 1
        self.reached = [0.0] * num_bins
        self.accepted = [0.0] * num_bins
        self.confidence_sum = [0.0] * num_bins  # of the reached ones: the bin's own prior

    def record(self, confidence: Sequence[float], num_accepted: int) -> None:
        """A verified draft with these per-token confidences; its first `num_accepted`
        tokens were accepted (the token after them, if any, was rejected; later ones were
        never tested)."""
        if not confidence:
            return
        decay = CALIBRATION_DECAY ** len(confidence)
        self.reached = [count * decay for count in self.reached]
        self.accepted = [count * decay for count in self.accepted]
        self.confidence_sum = [total * decay for total in self.confidence_sum]
        for position, value in enumerate(confidence[:num_accepted + 1]):
            index = _bin(value)
            self.reached[index] += 1.0
            self.confidence_sum[index] += value
            if position < num_accepted:
                self.accepted[index] += 1.0

    def rate(self, confidence: float) -> float:
        """Estimated chance that a token of this confidence is accepted given that the
        tokens before it were."""
        index = _bin(confidence)
        reached = self.reached[index]
        prior = self.confidence_sum[index] / reached if reached > 0.0 else confidence
        return (self.accepted[index] + PRIOR_WEIGHT * prior) / (reached + PRIOR_WEIGHT)

    def rates(self, confidence: Sequence[float]) -> list[float]:
        return [self.rate(value) for value in confidence]


def verified_lengths(rates: Sequence[Sequence[float]], num_plain_tokens: int, base_seconds: float,
                     token_seconds: float, first_draft_seconds: float) -> list[int]:
    """How many tokens of each draft to verify: the prefixes that maximise the step's
    expected tokens per second.

    `rates[i]`: draft i's calibrated per-token acceptance; `num_plain_tokens`: the tokens the
    step yields without any draft (one per sampling sequence); `base_seconds`: the step's
    predicted time without drafts, the paid round trip included; `token_seconds`: what one
    more verified row adds; `first_draft_seconds`: what a sequence's first verified draft
    row adds on top of that.
    """
    lengths = [0] * len(rates)
    expected, seconds = float(num_plain_tokens), base_seconds
    # Max-heap of (-expected tokens the next token adds, draft index, position).
    heap = [(-draft[0], index, 0) for index, draft in enumerate(rates) if draft]
    heapq.heapify(heap)
    while heap:
        negative_gain, index, position = heapq.heappop(heap)
        gain = -negative_gain
        cost = token_seconds + (first_draft_seconds if position == 0 else 0.0)
        if gain * seconds <= cost * expected:
            # Each token added raised expected / seconds, the bar a token must clear, and
            # the heap gives the largest gain first: no token at cost `token_seconds` pays
            # any more. Only a first token's failure (its extra row cost) leaves the rest.
            if position == 0:
                continue
            break
        lengths[index] = position + 1
        expected += gain
        seconds += cost
        draft = rates[index]
        if position + 1 < len(draft):
            heapq.heappush(heap, (-gain * draft[position + 1], index, position + 1))
    return lengths
