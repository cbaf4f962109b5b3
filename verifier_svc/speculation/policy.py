"""Adaptive speculation: how many draft tokens each sequence verifies this step (0 included).

A step verifying N tokens in all yields, per sequence, 1 token plus its accepted drafts,
and costs T(N) seconds of forward plus the drafting time. With per-position
*conditional* acceptance a_1, a_2, ... (a_i: the chance draft i is accepted given that
drafts 1..i-1 were), draft j of a sequence adds an expected p_j = a_1 * ... * a_j tokens
and costs one more verified token, dT/dN seconds (plus one more drafter step when j
exceeds every other sequence's draft length). The step's throughput G / T (expected
tokens over predicted seconds) grows with that draft iff p_j * T > cost * G. So the
plan starts every sequence at k = 0 and greedily adds the draft with the largest p_j
while that holds. The drafter's round trip is paid once a step however many sequences
draft, so while drafts are added it counts as paid, and the drafts are kept only if the
whole plan's G / T beats not asking at all.

Worked example: one request, T(N) = 30 ms + 0.2 ms * N, a flat-cost CPU verify. With
a = 0.8 everywhere, draft 1 adds 0.8 tokens for 0.2 ms (G = 1, T = 30.2 ms: 0.8 * 30.2
> 0.2 * 1), and so on up to the cap. At 16 requests on a compute-bound device with
T(N) = 5 ms + 1 ms * N, G = 16 and T = 21 ms: a draft pays only if p_j > 16 / 21 = 0.76,
so only the sequences whose drafts keep being accepted speculate.

What is measured, not assumed:
- acceptance per sequence and position, with the engine-wide rates as a prior (a new
  request starts from what drafts achieved so far; at a position its drafts have not
  reached yet, a sequence is expected to do at least as well as at the one before),
  exponentially forgetting old drafts so a request that leaves a repetitive passage stops
  drafting (the counts: verifier_svc/speculation/acceptance_stats.py);
- T(N, S), fit by exponentially weighted least squares (verifier_svc/speculation/step_cost.py) to
  decode steps' verify times (inputs, forward, logits, rejection sampling) against the
  tokens verified N and the sequences with drafts S: a sequence's first draft costs more
  than its later ones;
- drafting time against the longest draft asked, fit the same way; both fits priced at
  the machine's quiet speed (step_cost.QuietSpeed: a low quantile of recent timings over
  the fit's prediction for their counted work), since another process's load delays the
  drafter's round trip far more than the verify step and would price drafting out;
- apart from it, what a sequence's first ask (its whole context: for EAGLE and draft models
  the drafter prefills it) adds to a round trip, a median over recent ones: it is charged to
  a never-asked sequence's first draft (the shipped draft model's first ask cost 14-28 ms
  against an 8.6 ms step, and one request lost 7% to drafting at once). A drafter that
  needs no hidden states gets the prompt as the prefill starts (`Candidate.synced`), so
  its first ask is a steady one;
- per sequence, how often an ask returns any tokens at all (ngram finds no match on new
  text): an empty answer costs the round trip but no verification, so a draft's expected
  gain and its verification cost both scale by that chance, and the acceptance counts
  above are kept for proposals only.
The fits are linear in rows and blind to context length, so they are checked against
what steps realize (verifier_svc/speculation/realized.py): per batch-size bucket, while
steps that ask the drafter yield fewer tokens than plain steps of their size would in
their time, every cost of drafting (verified rows, first-draft terms, round trip, first
asks) is scaled up, in the plan and in `evidence_lengths`; the scale returns to 1 while
drafting pays or plain steps go by. Steps that only probe are left out of the check.

Sequences planned at k = 0 are probed now and then (one draft token, so that their
acceptance keeps being measured), and new ones soon after they start: when, and within
what share of the throughput, is verifier_svc/speculation/probe_schedule.py's; the plan prices each
idle sequence's probe at this step's costs.

The drafter's costs are measured only by asking, so prices can lock themselves in: at
eight requests one run's round-trip estimate came out of its first few round trips at 4.0
ms (1.0-1.4 in other runs), that made every probe and first ask dear, and for the rest of
the run nobody was asked and the estimate stayed 4.0 ms (on / off 0.991x, one draft token,
where a run with the estimate right drafted on 35% of its steps). So after
COST_REFRESH_PLANS plans without an ask, one sequence is asked anyway (at eight requests
~0.02% of the throughput) and its round trip replaces the estimate; and a round trip with
first asks that was cheaper than the steady estimate corrects it.
"""

from __future__ import annotations

from verifier_svc.speculation.acceptance_stats import AcceptanceStats, ProposalStats
from verifier_svc.speculation.candidate import Candidate
from verifier_svc.speculation.draft_allocation import (
    CandidateOutlook,
    DraftAllocation,
    StepPrices,
    allocate_drafts,
)
from verifier_svc.speculation.evidence import ConfidenceCalibration, verified_lengths
from verifier_svc.speculation.off_reasons import request_off_reason, step_off_reason
from verifier_svc.speculation.probe_schedule import (
    MAX_PROBE_INTERVAL,
    ProbeSchedule,
)
from verifier_svc.speculation.realized import RealizedThroughput
from verifier_svc.speculation.step_cost import (
    FirstAskCost,
    LinearCostModel,
    VerifyCostModel,
)

# Weight of the engine-wide rate in a sequence's estimate, in drafts.
PRIOR_WEIGHT = 2.0
# Per-draft forgetting of a sequence's counts, and of the engine-wide counts.
SEQUENCE_DECAY = 0.9
ENGINE_DECAY = 0.995
# The engine-wide rate before any draft was verified: optimistic, so drafting starts.
INITIAL_RATE = 0.6
# Plans without any ask after which one sequence is asked anyway, whatever the plan's
# prices: the drafter's cost is measured only by asking, and a high estimate that stops
# every ask would never be corrected (see the module docstring).
COST_REFRESH_PLANS = 2 * MAX_PROBE_INTERVAL

# A sequence's state after a plan (`SpeculationPolicy.states`): it drafts what the plan
# expects to pay; it is off but probed (one draft token, to measure acceptance again); off.
DRAFTING, PROBING, OFF = "drafting", "probing", "off"
POLICY_STATES = (DRAFTING, PROBING, OFF)


class SpeculationPolicy:
    """Plans per-sequence draft lengths from measured acceptance and step cost."""

    def __init__(self, max_speculative_tokens: int) -> None:
        self.max_speculative_tokens = max_speculative_tokens
        self.engine_stats = AcceptanceStats(ENGINE_DECAY)
        self._stats: dict[int, AcceptanceStats] = {}
        self.engine_proposals = ProposalStats(ENGINE_DECAY)
        self._proposals: dict[int, ProposalStats] = {}
        # Per sequence, (engine stats' version, its stats' version, its rates): while no
        # draft is recorded (a batch where nobody drafts) a plan reuses them.
        self._rates: dict[int, tuple[int, int, list[float]]] = {}
        self._num_plans = 0
        self.probes = ProbeSchedule()
        self._last_ask_plan = 0  # the last plan that asked the drafter for anyone
        self._draft_cost_stale = False  # a refresh asked: the next round trip replaces the fit
        self.verify_cost = VerifyCostModel()
        self.draft_cost = LinearCostModel(0.0)   # x: longest draft asked
        self.first_ask_cost = FirstAskCost()
        self.calibration = ConfidenceCalibration()
        self.realized = RealizedThroughput()
        # The last round trip's time beyond its quiet cost (the fit at the machine's quiet
        # speed, plus its first asks): another process's load, which lands on the drafter's
        # round trip far more than on the verify step. The realized check (observe_step)
        # takes it out of the drafting step it delayed, so that it compares drafting and
        # plain steps on the same footing: the steps' own work, under the load both share.
        self._round_trip_excess = 0.0
        # Set by each plan: why it planned no draft for each sequence that could draft
        # (not probes), by sequence id, and for the whole step when nobody drafts ("").
        self.off_reasons: dict[int, str] = {}
        self.step_off_reason = ""
        # Set by each plan: the state (POLICY_STATES) of each sequence that could draft.
        self.states: dict[int, str] = {}

    @property
    def last_probes(self) -> list[int]:
        """The sequences the last plan gave a probe (one draft token to re-measure, or to
        time the drafter again) rather than a draft it expects to pay: exploration."""
        return self.probes.probed

    # ------------------------------------------------------------ measurements

    def record_draft(self, seq_id: int, num_draft_tokens: int, num_accepted: int,
                     num_requested: int = 0) -> None:
        """A verified draft of `num_draft_tokens` of which `num_accepted` were accepted.
        `num_requested`: the tokens asked of the drafter (0: not asked this step). An empty
        answer to an ask (ngram finding no match) says nothing about acceptance; it lowers
        the sequence's chance of a proposal, which scales what asking is expected to gain."""
        if num_requested > 0:
            self.engine_proposals.record(num_draft_tokens > 0)
            proposals = self._proposals.get(seq_id)
            if proposals is None:
                proposals = self._proposals[seq_id] = ProposalStats(SEQUENCE_DECAY)
            proposals.record(num_draft_tokens > 0)
        if num_draft_tokens == 0:
            return
        self.engine_stats.record(num_draft_tokens, num_accepted)
        stats = self._stats.get(seq_id)
        if stats is None:
            stats = self._stats[seq_id] = AcceptanceStats(SEQUENCE_DECAY)
        stats.record(num_draft_tokens, num_accepted)

    def record_confidence(self, confidence: list[float], num_accepted: int) -> None:
        """A verified draft's per-token confidence (as the drafter sent it) and how many of
        its tokens were accepted: calibrates `evidence_lengths`."""
        self.calibration.record(confidence, num_accepted)

    def evidence_lengths(self, confidences: list[list[float]], num_plain_tokens: int,
                         num_other_tokens: int, paid_seconds: float) -> list[int]:
        """How many tokens of each arrived draft (by its per-token confidence) this step
        verifies: the prefixes maximising the step's expected tokens per second at the
        fitted verify cost (verifier_svc/speculation/evidence.py). `num_plain_tokens`: the
        step's sampling sequences; `num_other_tokens`: its prefill tokens; `paid_seconds`:
        the round trip already spent. Everything, before any verify step was timed."""
        if not self.verify_cost.has_data:
            return [len(confidence) for confidence in confidences]
        verify_base, verify_slope, verify_per_seq = self.verify_cost.fit()
        base = verify_base + verify_slope * (num_plain_tokens + num_other_tokens) + paid_seconds
        scale = self.realized.cost_scale(num_plain_tokens)
        return verified_lengths([self.calibration.rates(confidence) for confidence in confidences],
                                num_plain_tokens, base, verify_slope * scale, verify_per_seq * scale)

    def observe_step(self, num_seqs: int, asked: bool, num_tokens: int, seconds: float) -> None:
        """A decode step's wall time and tokens (`asked`: it asked the drafter; otherwise it
        drafted nothing): checks the fitted costs against what drafting realizes. A drafting
        step's round trip counts at its quiet cost (see `_round_trip_excess`)."""
        excess, self._round_trip_excess = self._round_trip_excess, 0.0
        if not self.verify_cost.has_data:
            return
        if asked:
            seconds -= excess
        verify_base, verify_slope, _ = self.verify_cost.fit()
        self.realized.observe(num_seqs, asked, num_tokens, seconds,
                              verify_base + verify_slope * num_seqs)

    def observe_verify(self, num_tokens: int, num_drafting_seqs: int, seconds: float) -> None:
        """A decode-only step's verify time: inputs, forward, logits and sampling of
        `num_tokens` tokens, `num_drafting_seqs` of the sequences with drafts."""
        self.verify_cost.observe(num_tokens, num_drafting_seqs, seconds)

    def observe_drafting(self, max_draft_tokens: int, seconds: float) -> None:
        if self._draft_cost_stale:  # re-measured after a spell without asks: start afresh
            self.draft_cost, self._draft_cost_stale = LinearCostModel(0.0), False
        self.draft_cost.observe(max_draft_tokens, seconds)
        self._round_trip_excess = max(0.0, seconds - self._steady_round_trip(max_draft_tokens))

    def observe_first_asks(self, num_first_asks: int, max_draft_tokens: int, seconds: float) -> None:
        """A round trip that carried `num_first_asks` sequences' first ask (their whole
        context), kept apart from the steady drafting cost: what it took beyond a steady
        round trip for the same longest draft is the first asks' share. One that took less
        than the steady estimate shows that estimate too high, and counts as a steady one."""
        if self._draft_cost_stale:
            # Re-measured after a spell without asks: this round trip, at most a steady
            # one's plus the first asks, replaces the estimate.
            self.observe_drafting(max_draft_tokens, seconds)
        steady = self._steady_round_trip(max_draft_tokens)
        self.first_ask_cost.observe(num_first_asks, seconds, steady)
        if seconds < steady:
            self.draft_cost.observe(max_draft_tokens, seconds)
        self._round_trip_excess = max(0.0, seconds - self._steady_round_trip(max_draft_tokens)
                                      - num_first_asks * self.first_ask_cost.per_first_ask())

    def _steady_round_trip(self, max_draft_tokens: int) -> float:
        base, per_token = self.draft_cost.fit()  # (0, 0) with no data
        return base + per_token * max_draft_tokens

    def first_ask_costs(self) -> tuple[float, float]:
        """(seconds of a one-token ask carrying one sequence's first ask, what a first ask
        adds to a steady round trip); zeros before any first ask was timed."""
        if not self.first_ask_cost.has_data:
            return 0.0, 0.0
        extra = self.first_ask_cost.per_first_ask()
        return self._steady_round_trip(1) + extra, extra

    def forget(self, seq_id: int) -> None:
        self._stats.pop(seq_id, None)
        self._proposals.pop(seq_id, None)
        self.probes.forget(seq_id)
        self._rates.pop(seq_id, None)

    # ------------------------------------------------------------ planning

    def engine_rates(self, num_positions: int) -> list[float]:
        """The engine-wide conditional acceptance estimates, every sequence's prior."""
        return [self.engine_stats.rate(position, INITIAL_RATE, 1.0) for position in range(num_positions)]

    def rates(self, seq_id: int, num_positions: int, engine_rates: list[float] | None = None) -> list[float]:
        """Conditional acceptance estimates for positions 0..num_positions-1; `engine_rates`:
        engine_rates(at least num_positions), when the caller has them."""
        if engine_rates is None:
            engine_rates = self.engine_rates(num_positions)
        stats = self._stats.get(seq_id)
        if stats is None:
            return engine_rates[:num_positions]
        cached = self._rates.get(seq_id)
        if (cached is not None and cached[0] == self.engine_stats.version and cached[1] == stats.version
                and len(cached[2]) == num_positions):
            return cached[2]
        rates: list[float] = []
        for position in range(num_positions):
            prior = engine_rates[position]
            if position > 0 and not stats.has_reached(position):
                # A sequence whose drafts are accepted at the position before is expected to
                # do as well here until measured: drafts that stop short of a position never
                # measure it, and other requests' rate there kept a repeat prompt's drafts at
                # one token among open ones.
                prior = max(prior, rates[-1])
            rates.append(stats.rate(position, prior, PRIOR_WEIGHT))
        self._rates[seq_id] = (self.engine_stats.version, stats.version, rates)
        return rates

    def proposal_rate(self, seq_id: int, prior: float | None = None) -> float:
        """Estimated chance that asking the drafter for this sequence returns any tokens;
        `prior`: the engine-wide chance, when the caller has it."""
        if prior is None:
            prior = self.engine_proposals.rate(1.0, 1.0)
        proposals = self._proposals.get(seq_id)
        return prior if proposals is None else proposals.rate(prior, PRIOR_WEIGHT)

    def plan(self, candidates: list[Candidate], num_other_tokens: int = 0) -> dict[int, int]:
        """Draft length per sequence id for one step.

        `num_other_tokens`: tokens the forward runs besides these sequences' one token each
        (prefill chunks), which make the step slower and drafts relatively cheaper.
        """
        plan = self._plan(candidates, num_other_tokens)
        probed = set(self.probes.probed)
        self.states = {candidate.seq_id: (OFF if not plan.get(candidate.seq_id)
                                          else PROBING if candidate.seq_id in probed
                                          else DRAFTING)
                       for candidate in candidates if candidate.max_tokens > 0}
        return plan

    def _plan(self, candidates: list[Candidate], num_other_tokens: int) -> dict[int, int]:
        self.probes.start_plan()
        self.off_reasons, self.step_off_reason = {}, ""
        if not self.verify_cost.has_data:
            return {c.seq_id: c.max_tokens for c in candidates}  # nothing measured yet
        self._num_plans += 1
        plan = {candidate.seq_id: 0 for candidate in candidates}
        if not any(candidate.max_tokens > 0 for candidate in candidates):
            return plan  # nothing may draft (e.g. speculation off): no fits, no probes
        prices = self._prices(candidates, num_other_tokens)
        outlook = self._outlook(candidates)
        allocation = allocate_drafts(candidates, prices, outlook, plan)
        if not allocation.pays(prices):
            self.step_off_reason = step_off_reason(self.realized, candidates, prices, outlook,
                                                   allocation)
            plan = dict.fromkeys(plan, 0)
            allocation = DraftAllocation(prices.plain_tokens, prices.plain_seconds)
        self._note_off_reasons(candidates, plan, outlook)
        self.probes.plan_priced_probes(self._num_plans, candidates, plan, prices, outlook,
                                       allocation)
        if any(plan.values()):
            self._last_ask_plan = self._num_plans
        elif self._num_plans - self._last_ask_plan >= COST_REFRESH_PLANS:
            self._refresh_cost(candidates, plan, outlook.pays_first_ask)
        return plan

    def _prices(self, candidates: list[Candidate], num_other_tokens: int) -> StepPrices:
        """This step's costs from the fits; drafting's scaled by what drafting steps realized
        against plain ones at this batch size (realized.py; 1 while they pay as fitted)."""
        verify_base, verify_slope, verify_per_seq = self.verify_cost.fit()
        draft_base, draft_per_token = self.draft_cost.fit()
        num_tokens = len(candidates) + num_other_tokens
        scale = self.realized.cost_scale(len(candidates))
        first_ask_round_trip, first_ask_seconds = (cost * scale for cost in self.first_ask_costs())
        return StepPrices(float(len(candidates)), verify_base + verify_slope * num_tokens,
                          verify_slope * scale, verify_per_seq * scale, draft_base * scale,
                          draft_per_token * scale, first_ask_round_trip, first_ask_seconds)

    def _outlook(self, candidates: list[Candidate]) -> CandidateOutlook:
        """Each candidate's acceptance and proposal estimates, and whether it pays a first
        ask: a sequence never asked for pays it with its first draft (its context; for EAGLE
        and draft models the drafter's prefill of it) unless the drafter holds it already."""
        never_asked = [candidate.seq_id not in self._proposals and candidate.seq_id not in self._stats
                       for candidate in candidates]
        # The priors once a plan, not once a sequence (the plan runs every step).
        engine_rates = self.engine_rates(max(candidate.max_tokens for candidate in candidates))
        engine_proposing = self.engine_proposals.rate(1.0, 1.0)
        return CandidateOutlook(
            rates=[self.rates(candidate.seq_id, candidate.max_tokens, engine_rates)
                   for candidate in candidates],
            proposing=[self.proposal_rate(candidate.seq_id, engine_proposing)
                       for candidate in candidates],
            never_asked=never_asked,
            pays_first_ask=[first and not candidate.synced
                            for first, candidate in zip(never_asked, candidates)])

    def _note_off_reasons(self, candidates: list[Candidate], plan: dict[int, int],
                          outlook: CandidateOutlook) -> None:
        for index, candidate in enumerate(candidates):
            if candidate.max_tokens > 0 and plan[candidate.seq_id] == 0:
                self.off_reasons[candidate.seq_id] = self.step_off_reason or request_off_reason(
                    outlook.first_gain(index), len(candidates))

    def _refresh_cost(self, candidates: list[Candidate], plan: dict[int, int], pays_first_ask: list[bool]) -> None:
        """Plans one draft token for one sequence that may draft (one asked before, whose
        round trip is a steady one, where there is one), so that the drafter's round trip is
        timed again; that timing replaces the estimate no ask had confirmed for so long."""
        allowed = [index for index, candidate in enumerate(candidates) if candidate.max_tokens > 0]
        if not allowed:
            return
        index = min(allowed, key=lambda index: pays_first_ask[index])  # a steady round trip first
        seq_id = candidates[index].seq_id
        plan[seq_id] = 1
        self.probes.probe_now(seq_id)
        self._last_ask_plan = self._num_plans
        self._draft_cost_stale = True
