"""The core of a speculation plan: which drafts pay at this step's prices.

`StepPrices` holds one step's costs and `CandidateOutlook` what each candidate is expected
to do (verifier_svc/speculation/policy.py measures both); `allocate_drafts` then starts
every sequence at k = 0 and greedily adds the draft with the largest expected gain while
its gain over its cost beats the plan's tokens per second so far (the derivation is in
policy.py's docstring).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from verifier_svc.speculation.candidate import Candidate


@dataclass(frozen=True, slots=True)
class StepPrices:
    """One step's costs in seconds: a plain step's, and drafting's scaled by what drafting
    steps realized at this batch size (realized.py; unscaled while they pay as fitted)."""

    plain_tokens: float
    plain_seconds: float
    verify_slope: float  # one more verified token
    verify_per_seq: float  # a sequence's first draft token, beyond verify_slope
    draft_base: float  # the drafter's round trip
    draft_per_token: float  # one more token of the longest draft
    first_ask_round_trip: float  # a one-token ask carrying one first ask; 0: none timed
    first_ask_seconds: float  # what a first ask adds to a round trip


@dataclass(frozen=True, slots=True)
class CandidateOutlook:
    """What the plan expects of each candidate, by its index in the plan's list."""

    rates: list[list[float]]  # conditional acceptance per draft position
    proposing: list[float]  # chance that an ask returns tokens to verify
    never_asked: list[bool]
    pays_first_ask: list[bool]  # its first draft carries a first ask (its context, not synced)

    def first_gain(self, index: int) -> float:
        """The tokens candidate `index`'s first draft token is expected to add."""
        return self.proposing[index] * self.rates[index][0]


@dataclass(slots=True)
class DraftAllocation:
    """The drafts chosen (`longest` 0: none) and the step's expected tokens and seconds."""

    expected_tokens: float
    seconds: float
    longest: int = 0

    def pays(self, prices: StepPrices) -> bool:
        """Whether the drafts beat not asking the drafter at all."""
        return bool(self.longest) and (self.expected_tokens * prices.plain_seconds
                                       > prices.plain_tokens * self.seconds)


def allocate_drafts(candidates: list[Candidate], prices: StepPrices, outlook: CandidateOutlook,
                    plan: dict[int, int]) -> DraftAllocation:
    """Sets each candidate's draft length in `plan` (every one at 0 on entry).

    The drafter's round trip is paid once for all of a step's drafts, so no single draft
    need pay it: the drafts are planned as if it were paid, and the caller keeps them only
    if together they beat not asking (at eight requests here no one draft paid a 1.2 ms
    round trip alone, and only probes drafted)."""
    allocation = DraftAllocation(prices.plain_tokens, prices.plain_seconds + prices.draft_base)
    heap = _first_drafts(candidates, prices, outlook, allocation)
    while heap:
        negative_gain, index, position = heapq.heappop(heap)
        gain = -negative_gain
        # Verification is paid only when the drafter proposes; the ask itself always.
        cost = outlook.proposing[index] * (prices.verify_slope
                                           + (prices.verify_per_seq if position == 0 else 0.0))
        if position == 0 and outlook.pays_first_ask[index]:
            cost += prices.first_ask_seconds
        if position + 1 > allocation.longest:
            cost += prices.draft_per_token
        if gain * allocation.seconds <= cost * allocation.expected_tokens:
            continue
        candidate = candidates[index]
        plan[candidate.seq_id] = position + 1
        allocation.expected_tokens += gain
        allocation.seconds += cost
        allocation.longest = max(allocation.longest, position + 1)
        if position + 1 < candidate.max_tokens:
            heapq.heappush(heap, (-gain * outlook.rates[index][position + 1], index, position + 1))
    return allocation


def _first_drafts(candidates: list[Candidate], prices: StepPrices, outlook: CandidateOutlook,
                  allocation: DraftAllocation) -> list[tuple[float, int, int]]:
    """Max-heap of (-expected tokens the next draft adds, candidate index, its position),
    holding each candidate's first draft that may pay. One that does not pay at the least it
    can cost never will (the plan's tokens per second only rise as drafts are added)."""
    heap: list[tuple[float, int, int]] = []
    for index, candidate in enumerate(candidates):
        if candidate.max_tokens > 0:
            gain = outlook.first_gain(index)
            least_cost = outlook.proposing[index] * (prices.verify_slope + prices.verify_per_seq)
            if outlook.pays_first_ask[index]:
                least_cost += prices.first_ask_seconds
            if gain * allocation.seconds > least_cost * allocation.expected_tokens:
                heapq.heappush(heap, (-gain, index, 0))
    return heap
