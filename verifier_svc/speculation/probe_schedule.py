"""Probes: a sequence the plan does not draft for verifies one draft token now and then, so
that its acceptance keeps being measured; this module says when, each probe priced at the
step's costs (used by verifier_svc/speculation/policy.py).

A sequence planned at k = 0 is probed: it verifies one draft token, so its acceptance
keeps being measured (a passage can become predictable again). The wait before a probe
backs off: FIRST_PROBE_INTERVAL steps after the sequence stops drafting, doubling after
each probe that does not bring drafting back, up to PROBE_INTERVAL. A sequence stopped by
a bad start (a repeat prompt whose first drafts miss) is back within a few steps; a hopeless
one costs three extra probes in its life. Probes wait for a step that asks the drafter
anyway, or for a step number divisible by the wait (a power of two): sequences that
started at different times then probe together, and a batch where nobody drafts pays one
drafter round trip per interval, not one per sequence per interval. New sequences' first
probes keep to a grid too: every FIRST_PROBE_INTERVAL-th step while new sequences are rare,
coarser (up to PROBE_INTERVAL) where they arrive so often that the round trips asked for
first probes alone would cost more than FIRST_PROBE_ASK_BUDGET of the throughput. At
sixteen requests here a request arrived every ~7 steps, and 32-37 steps of a 144-request
run asked the drafter only for first probes, losing 25-63 tokens net (~1%); on a grid of
PROBE_INTERVAL two runs had 4 and 15 such steps, losing 3 and 9.

Probes are exploration, paid for in throughput, and where verification is dear they are
spaced further. A probe's expected loss, in tokens of the planned step's throughput, is its
verification time (plus its share of a round trip on a step that would not ask) times
tokens per second, less the tokens it is expected to add; each idle sequence's wait is
raised, in powers of two up to MAX_PROBE_INTERVAL, until the idle sequences' losses
together stay under PROBE_BUDGET of the step's tokens, scaled by what finding a passage the
drafter predicts well (accepted at HOPEFUL_RATE) would be worth: the share of its expected
tokens left after paying for their verification. Where verifying a token costs more than
0.9 of one, nothing a probe could find would pay, and the waits go to the maximum. A
sequence's first probe is not priced: its estimate is other requests' rates until then, and
at eight requests a priced first wait (256 steps) outlived the request, so a repeat prompt
among open ones never drafted. Unless asking is dear: the first ask for a sequence carries
its whole context, for ngram a few hundred token ids, for EAGLE every context token's hidden
states, which the drafter prefills before three passes of its head. Round trips that carry
first asks are timed apart, and where one costs more than FREE_FIRST_ASK_TOKENS of the
step's throughput the first probe is priced as the others are, what the first ask adds
included (EAGLE-3 at eight requests: such a round trip ~6 ms against a 14 ms step, steps
with first probes ran at 63-67% of plain ones' tokens/s, and on / off was 0.92-0.95x).

Measured on a 2-core CPU with the default model: one request's extra verified token costs
~10% of its step (a probe every 16 steps: ~0.6%, the wait stays 16), but at eight
requests whose step is compute-bound an extra token costs ~9% of the whole batch's step,
so eight probes together cost 70% of a step: every 16 steps, 4.6% of the throughput for
drafts that open text rarely accepts. At sixteen, a server whose probes were held to 1%
still lost ~1.6% against no speculation, and one that never probed broke even.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verifier_svc.speculation.candidate import Candidate
    from verifier_svc.speculation.draft_allocation import CandidateOutlook, DraftAllocation, StepPrices

# Steps a sequence may go undrafted before one draft token is verified to re-measure:
# FIRST_PROBE_INTERVAL, doubling per fruitless probe up to PROBE_INTERVAL (powers of two).
FIRST_PROBE_INTERVAL = 4
PROBE_INTERVAL = 16
# The share of a step's expected tokens the idle sequences' probes may cost together, and
# the longest wait that keeping to it may impose (a power of two).
PROBE_BUDGET = 0.01
MAX_PROBE_INTERVAL = 256
# The acceptance of a passage the drafter predicts well: what a probe may find. The budget
# shrinks with the share of such a passage's gain that verifying its drafts would cost.
HOPEFUL_RATE = 0.9
# What the round trips made only for new sequences' first probes may cost together, as a
# share of the throughput: past it first probes keep to a coarser grid of steps (up to
# PROBE_INTERVAL), so more of them share a round trip.
FIRST_PROBE_ASK_BUDGET = PROBE_BUDGET / 2
# Per-plan forgetting of how often new sequences arrive.
ARRIVAL_DECAY = 0.98
# What a round trip carrying a first ask may cost, in tokens of the step's throughput, with
# the sequence's first probe still unpriced: ngram's, its context's token ids and a lookup,
# ~1 token at sixteen requests here; EAGLE-3's, its hidden states and three passes of its
# head, ~3 at eight.
FREE_FIRST_ASK_TOKENS = 2.0


def affordable_wait(loss: float, num_idle: int, budget_tokens: float) -> int:
    """The shortest wait (a power of two, at most MAX_PROBE_INTERVAL) at which `num_idle`
    sequences probing once per wait, each at an expected `loss` in tokens, cost at most
    `budget_tokens` a step."""
    wait = 1
    while wait < MAX_PROBE_INTERVAL and loss * num_idle > budget_tokens * wait:
        wait *= 2
    return wait


def first_probe_grid(arrival_rate: float, round_trip_share: float) -> int:
    """The steps (a power of two from FIRST_PROBE_INTERVAL to PROBE_INTERVAL) whose numbers
    new sequences' first probes keep to when no other draft asks the drafter.

    `arrival_rate`: the share of recent plans that saw a new sequence; `round_trip_share`: a
    round trip's time over a plain step's. On a grid of G steps a round trip made only for
    first probes comes on about min(arrival_rate, 1 / G) of the steps: the grid is the
    finest at which that costs at most FIRST_PROBE_ASK_BUDGET of the throughput. One request
    at a time never waits beyond FIRST_PROBE_INTERVAL; at sixteen, where a request arrives
    every ~7 steps and a round trip is ~6% of a step, the grid is PROBE_INTERVAL."""
    grid = FIRST_PROBE_INTERVAL
    while grid < PROBE_INTERVAL and round_trip_share * min(arrival_rate, 1.0 / grid) > FIRST_PROBE_ASK_BUDGET:
        grid *= 2
    return grid


def hopeful_share(max_tokens: int, token_cost: float) -> float:
    """What drafting up to `max_tokens` would net on a passage accepted at HOPEFUL_RATE, as
    a share of its expected tokens, when each verified token costs `token_cost` tokens: 1
    where verifying is free, 0 where not even such a passage's first draft pays."""
    expected = [HOPEFUL_RATE ** position for position in range(1, max_tokens + 1)]
    return sum(max(0.0, tokens - token_cost) for tokens in expected) / sum(expected)


class ProbeSchedule:
    """Per sequence, the steps it has gone undrafted and its back-off; engine-wide, how often
    new sequences arrive; and the sequences the last plan probed."""

    def __init__(self) -> None:
        self._idle_steps: dict[int, int] = {}
        self._waits: dict[int, int] = {}  # the back-off: steps undrafted before a probe
        self._arrival_rate = 0.0  # the share of recent plans that saw a new sequence (decayed)
        self.probed: list[int] = []  # by the current plan

    def start_plan(self) -> None:
        self.probed = []

    def probe_now(self, seq_id: int) -> None:
        """A probe planned outside the schedule (to time the drafter again)."""
        self.probed.append(seq_id)
        self._idle_steps[seq_id] = 0

    def forget(self, seq_id: int) -> None:
        self._idle_steps.pop(seq_id, None)
        self._waits.pop(seq_id, None)

    def plan_probes(self, plan_number: int, candidates: list[Candidate], plan: dict[int, int],
                    priced_wait: Callable[[int], int], free_first_probe: list[bool],
                    round_trip_share: float) -> None:
        """Plans one draft token for each sequence whose probe wait has passed, on a step
        that asks the drafter anyway or whose number the wait divides (for a never-asked
        sequence's unpriced first probe, the first-probe grid: see `first_probe_grid`, and
        `round_trip_share`, a round trip over a plain step's time). The wait is the
        back-off's or, where probes are dear, `priced_wait(candidate index)` (see the module
        docstring), priced only once the back-off has passed and only for a sequence asked
        for before, or for any while first asks are dear (`never_asked`: per candidate)."""
        asking = any(plan.values())
        first_grid = first_probe_grid(self._arrival_rate, round_trip_share)
        arrived = False
        for index, candidate in enumerate(candidates):
            seq_id = candidate.seq_id
            arrived = arrived or seq_id not in self._idle_steps
            if plan[seq_id] > 0 or candidate.max_tokens == 0:
                self._idle_steps[seq_id] = 0
                if plan[seq_id] > 0:
                    self._waits[seq_id] = FIRST_PROBE_INTERVAL
                continue
            idle = self._idle_steps.get(seq_id, 0) + 1
            backoff = self._waits.get(seq_id, FIRST_PROBE_INTERVAL)
            if idle < backoff or not (asking or plan_number % backoff == 0):
                # No probe yet, whatever it would cost: every wait below is a power of two
                # from the back-off up, so a step number the back-off does not divide is
                # divided by none of them (and a wait is priced only where it could fire).
                self._idle_steps[seq_id] = idle
                continue
            # A sequence never drafted for is probed at the back-off alone: its estimate is
            # other requests' rates, and whether a new request is predictable (a repeat
            # prompt among open ones) is worth one verified token to learn.
            if free_first_probe[index]:
                wait, grid = backoff, max(backoff, first_grid)
            else:
                wait = grid = max(backoff, priced_wait(index))
            if idle >= wait and (asking or plan_number % grid == 0):
                plan[seq_id] = 1
                self.probed.append(seq_id)
                idle = 0
                self._waits[seq_id] = min(2 * wait, PROBE_INTERVAL)
            self._idle_steps[seq_id] = idle
        self._arrival_rate = self._arrival_rate * ARRIVAL_DECAY + (1.0 - ARRIVAL_DECAY) * arrived

    def plan_priced_probes(self, plan_number: int, candidates: list[Candidate], plan: dict[int, int],
                           prices: StepPrices, outlook: CandidateOutlook,
                           allocation: DraftAllocation) -> None:
        """Gives idle sequences their probes (`plan_probes`), each priced in seconds of this
        step: its verification (scaled, as a draft's, by the chance that the drafter
        proposes), and on a step that would not ask the drafter, the round trip shared by
        the idle sequences."""
        num_idle = sum(1 for candidate in candidates
                       if plan[candidate.seq_id] == 0 and candidate.max_tokens > 0)
        ask_seconds = (0.0 if allocation.longest
                       else (prices.draft_base + prices.draft_per_token) / max(1, num_idle))
        tokens_per_second = (allocation.expected_tokens / allocation.seconds
                             if allocation.seconds > 0 else 0.0)
        token_cost = prices.verify_slope * tokens_per_second  # one more verified token, in tokens
        hopeful_shares: dict[int, float] = {}  # by draft cap: the same for every sequence

        def priced_wait(index: int) -> int:
            """The wait that keeps candidate `index`'s share of the probes within budget (a
            never-asked sequence's probe carries its first ask)."""
            probe_seconds = (outlook.proposing[index] * (prices.verify_slope + prices.verify_per_seq)
                             + ask_seconds)
            if outlook.pays_first_ask[index]:
                probe_seconds += prices.first_ask_seconds
            loss = probe_seconds * tokens_per_second - outlook.first_gain(index)
            max_tokens = candidates[index].max_tokens
            share = hopeful_shares.get(max_tokens)
            if share is None:
                share = hopeful_shares[max_tokens] = hopeful_share(max_tokens, token_cost)
            return affordable_wait(loss, num_idle,
                                                  PROBE_BUDGET * share * allocation.expected_tokens)

        first_probe_round_trip = (prices.first_ask_round_trip
                                  or prices.draft_base + prices.draft_per_token)
        first_ask_is_dear = prices.first_ask_round_trip * tokens_per_second > FREE_FIRST_ASK_TOKENS
        free_first_probe = [first and not (pays and first_ask_is_dear)
                            for first, pays in zip(outlook.never_asked, outlook.pays_first_ask)]
        self.plan_probes(plan_number, candidates, plan, priced_wait, free_first_probe,
                         first_probe_round_trip / prices.plain_seconds
                         if prices.plain_seconds > 0 else 0.0)
