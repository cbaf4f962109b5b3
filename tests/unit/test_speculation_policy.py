"""verifier_svc.speculation.policy: draft lengths from measured acceptance and step cost."""

from __future__ import annotations

import random

import pytest

from tests.support.policy_training import MS, policy_with_cost, teach
from verifier_svc.speculation.acceptance_stats import AcceptanceStats
from verifier_svc.speculation.candidate import Candidate
from verifier_svc.speculation.policy import (
    COST_REFRESH_PLANS,
    SpeculationPolicy,
)
from verifier_svc.speculation.probe_schedule import (
    FIRST_PROBE_INTERVAL,
    HOPEFUL_RATE,
    MAX_PROBE_INTERVAL,
    PROBE_BUDGET,
    PROBE_INTERVAL,
    hopeful_share,
)
from verifier_svc.speculation.step_cost import (
    LinearCostModel,
    VerifyCostModel,
    _solve_linear,
)


# Drafts of 4 accepting 0, 1, 2, 3, 4 tokens in turn: conditional acceptance 0.8, 0.75,
# 0.67, 0.5 at positions 1..4.
MIXED = (0, 1, 2, 3, 4)


def test_acceptance_is_conditional_per_position() -> None:
    stats = AcceptanceStats(decay=1.0)
    stats.record(3, 1)  # position 0 accepted, position 1 rejected, position 2 never reached
    stats.record(3, 3)
    assert stats.reached == [2.0, 2.0, 1.0]
    assert stats.accepted == [2.0, 1.0, 1.0]
    assert stats.rate(1, prior=0.0, prior_weight=0.0) == 0.5
    assert stats.rate(5, prior=0.3, prior_weight=2.0) == 0.3  # never drafted: the prior


def test_reused_rates_follow_every_recorded_draft() -> None:
    """A plan reuses a sequence's estimates until a draft is recorded (its own or any other
    sequence's, which moves the engine-wide prior): they always equal fresh ones."""
    rng = random.Random(0)
    policy = SpeculationPolicy(4)
    for _ in range(300):
        seq_id = rng.randrange(4)
        if rng.random() < 0.5:
            num_draft_tokens = rng.randrange(5)
            policy.record_draft(seq_id, num_draft_tokens, rng.randrange(num_draft_tokens + 1))
        if rng.random() < 0.05:
            policy.forget(seq_id)
        num_positions = rng.randrange(1, 5)
        reused = policy.rates(seq_id, num_positions)
        policy._rates.clear()
        assert reused == policy.rates(seq_id, num_positions)


def test_the_cost_fit_solves_its_system_exactly() -> None:
    # A gram matrix of features (1, N, S) like the fit's, and one with a zero first pivot.
    for matrix, solution in ((([[50.0, 500.0, 40.0], [500.0, 5200.0, 420.0], [40.0, 420.0, 60.0]]),
                              [0.004, 0.0007, 0.0002]),
                             ([[0.0, 2.0, 1.0], [2.0, 1.0, 0.0], [1.0, 0.0, 3.0]], [1.0, -2.0, 0.5])):
        rhs = [sum(row[j] * solution[j] for j in range(3)) for row in matrix]
        assert _solve_linear(matrix, rhs) == pytest.approx(solution, rel=1e-9)


def test_cost_model_fits_base_and_slope() -> None:
    model = LinearCostModel(prior_slope_fraction=0.5)
    for num_tokens in (1, 2, 3, 5, 8, 13):
        model.observe(num_tokens, 0.010 + 0.002 * num_tokens)
    base, slope = model.fit()
    assert base == pytest.approx(0.010) and slope == pytest.approx(0.002)


def test_cost_model_uses_the_prior_slope_until_sizes_vary() -> None:
    model = LinearCostModel(prior_slope_fraction=1 / 32)
    for _ in range(5):
        model.observe(1, 0.030)
    base, slope = model.fit()
    assert base + slope == pytest.approx(0.030) and slope == pytest.approx(base / 32)


def test_verify_cost_separates_tokens_from_drafting_sequences() -> None:
    model = VerifyCostModel()
    for num_tokens in range(1, 33):
        num_seqs = (num_tokens * 7) % 5
        model.observe(num_tokens, num_seqs, 0.020 + 0.001 * num_tokens + 0.004 * num_seqs)
    base, per_token, per_seq = model.mean_fit()  # the fit of the timings; fit() scales it to the quiet speed
    assert base == pytest.approx(0.020, rel=0.1)
    assert per_token == pytest.approx(0.001, rel=0.1) and per_seq == pytest.approx(0.004, rel=0.1)


def test_verify_cost_falls_back_on_its_prior() -> None:
    model = VerifyCostModel()
    for _ in range(10):
        model.observe(1, 0, 0.030)
    base, per_token, per_seq = model.fit()
    assert base + per_token == pytest.approx(0.030, rel=0.05)
    assert per_token == pytest.approx(base / 32, rel=0.2) and per_seq == pytest.approx(0.0, abs=1e-3)


def test_a_timing_spike_counts_as_a_bounded_slowdown() -> None:
    """One 100x round trip (a first call, a pause) after steady 1 ms ones moves the drafting
    cost by at most SPIKE_FACTOR's worth; steady timings then bring it back."""
    drafting = LinearCostModel(prior_slope_fraction=0.0)
    verify = VerifyCostModel()
    for _ in range(20):
        drafting.observe(2, 1 * MS)
        verify.observe(1, 0, 10 * MS)
    drafting.observe(2, 100 * MS)
    verify.observe(1, 0, 1000 * MS)
    base, slope = drafting.fit()
    assert base + 2 * slope < 1.3 * MS
    base, per_token, per_seq = verify.fit()
    assert base + per_token < 13 * MS
    # A lasting slowdown is learnt all the same.
    for _ in range(60):
        drafting.observe(2, 5 * MS)
    base, slope = drafting.fit()
    assert base + 2 * slope == pytest.approx(5 * MS, rel=0.2)


def test_one_slow_round_trip_does_not_stop_drafting() -> None:
    """Drafting stays on after one slow drafter call: were the spike believed, the policy
    would stop asking and never time the drafter again."""
    policy = policy_with_cost(10 * MS, 0.1 * MS, draft_s=0.5 * MS)
    teach(policy, 1, num_drafts=30, k=4, num_accepted=MIXED)
    policy.observe_drafting(4, 200 * MS)
    assert policy.plan([Candidate(1, 4)])[1] > 0


def test_a_costly_first_draft_needs_a_sequence_worth_it() -> None:
    # The first draft of a sequence costs 3 ms more than its tokens: worth it for a sequence
    # whose drafts are always accepted, not for one whose drafts fail half the time.
    policy = policy_with_cost(10 * MS, 0.1 * MS, per_seq_s=3 * MS)
    teach(policy, 1, num_drafts=30, k=4, num_accepted=4)
    teach(policy, 2, num_drafts=30, k=4, num_accepted=(0, 1))
    plan = policy.plan([Candidate(1, 4), Candidate(2, 4)])
    assert plan[1] == 4 and plan[2] == 0


def test_a_position_not_yet_reached_is_expected_to_do_as_well_as_the_one_before() -> None:
    # Other requests' second draft tokens always fail; these eight sequences' one-token
    # drafts are always accepted, so nothing measured their second position. Expected to
    # do as well there as at the first, they draft longer (at other requests' rate a second
    # token would never be drafted, so never measured); once measured, their own rate rules.
    policy = policy_with_cost(10 * MS, 0.9 * MS)
    for seq_id in range(100, 108):
        teach(policy, seq_id, num_drafts=30, k=2, num_accepted=1)
    for seq_id in range(8):
        teach(policy, seq_id, num_drafts=10, k=1, num_accepted=1)
    candidates = [Candidate(seq_id, 4) for seq_id in range(8)]
    assert all(k >= 2 for k in policy.plan(candidates).values())
    for seq_id in range(8):
        teach(policy, seq_id, num_drafts=10, k=2, num_accepted=1)
    assert all(k == 1 for k in policy.plan(candidates).values())


def test_a_round_trip_no_one_draft_pays_is_paid_by_the_batchs_drafts() -> None:
    # Eight sequences on a compute-bound step, T(N) = 10 ms + 0.9 ms * N, whose drafts are
    # always accepted, and a 1.5 ms drafter round trip. One draft adds ~1 token (~0.56 of a
    # step's tokens a ms) but would cost 0.9 + 1.5 ms: alone it does not pay. Drafting for
    # all eight does (~0.66 tokens a ms against ~0.47 without), so all draft; a round trip
    # dearer than every draft together gains is not paid.
    for round_trip_ms, drafting in ((1.5, True), (60.0, False)):
        policy = policy_with_cost(10 * MS, 0.9 * MS, draft_s=round_trip_ms * MS)
        for seq_id in range(8):
            teach(policy, seq_id, num_drafts=30, k=4, num_accepted=4)
        plan = policy.plan([Candidate(seq_id, 4) for seq_id in range(8)])
        assert all(plan[seq_id] > 0 for seq_id in range(8)) if drafting else not any(plan.values())


def test_nothing_measured_means_every_sequence_drafts_its_cap() -> None:
    policy = SpeculationPolicy(4)
    assert policy.plan([Candidate(1, 4), Candidate(2, 2), Candidate(3, 0)]) == {1: 4, 2: 2, 3: 0}


@pytest.mark.parametrize(("base_ms", "per_token_ms", "num_accepted", "expected_k"), [
    # A flat-cost verify (CPU weight-bound, one request): drafts pay when accepted.
    (30.0, 0.1, 4, 4),
    (30.0, 0.1, MIXED, 4),
    # The third draft token is always rejected: verifying it is a waste.
    (30.0, 0.1, 2, 2),
    # Compute-bound verify, every token as costly as the base step (T(1) = 2 ms): a draft
    # token pays while its chance of being reached and accepted beats tokens per ms so
    # far; with MIXED that is about 0.8 and 0.65 for the first two, not 0.45 for the third.
    (1.0, 1.0, 4, 4),
    (1.0, 1.0, MIXED, 2),
    (1.0, 1.0, 0, 0),
])
def test_one_sequence(base_ms: float, per_token_ms: float, num_accepted: int | tuple[int, ...],
                      expected_k: int) -> None:
    policy = policy_with_cost(base_ms * MS, per_token_ms * MS)
    teach(policy, 7, num_drafts=30, k=4, num_accepted=num_accepted)
    assert policy.plan([Candidate(7, 4)]) == {7: expected_k}


def test_a_busy_batch_drafts_only_where_drafts_are_accepted() -> None:
    # 16 sequences, T(N) = 5 ms + 1 ms * N: a draft must add > ~0.75 expected tokens.
    policy = policy_with_cost(5 * MS, 1 * MS)
    for seq_id in range(16):
        teach(policy, seq_id, num_drafts=30, k=4, num_accepted=4 if seq_id < 4 else 0)
    plan = policy.plan([Candidate(seq_id, 4) for seq_id in range(16)])
    assert all(plan[seq_id] >= 3 for seq_id in range(4))
    assert all(plan[seq_id] == 0 for seq_id in range(4, 16))


def test_cheaper_verification_drafts_more() -> None:
    light = policy_with_cost(20 * MS, 0.2 * MS)
    heavy = policy_with_cost(2 * MS, 2 * MS)
    for policy in (light, heavy):
        for seq_id in range(8):
            teach(policy, seq_id, num_drafts=30, k=4, num_accepted=MIXED)
    candidates = [Candidate(seq_id, 4) for seq_id in range(8)]
    assert sum(light.plan(candidates).values()) > sum(heavy.plan(candidates).values())


def test_slow_drafting_shortens_drafts() -> None:
    fast = policy_with_cost(10 * MS, 0.1 * MS, draft_s=0.0)
    slow = SpeculationPolicy(4)
    for num_tokens in range(1, 17):
        slow.observe_verify(num_tokens, num_tokens % 4, 10 * MS + 0.1 * MS * num_tokens)
    for max_k in (1, 2, 3, 4) * 4:
        slow.observe_drafting(max_k, 6 * MS * max_k)  # each draft token: a 6 ms drafter step
    for policy in (fast, slow):
        teach(policy, 1, num_drafts=30, k=4, num_accepted=MIXED)
    assert fast.plan([Candidate(1, 4)])[1] == 4
    assert slow.plan([Candidate(1, 4)])[1] < 4


def test_a_new_sequence_starts_from_the_engine_wide_rates() -> None:
    policy = policy_with_cost(1 * MS, 1 * MS)
    teach(policy, 1, num_drafts=60, k=4, num_accepted=0)
    assert policy.plan([Candidate(2, 4)]) == {2: 0}  # drafts have not been accepted anywhere


def test_a_sequence_that_stopped_drafting_is_probed() -> None:
    policy = policy_with_cost(10 * MS, 0.2 * MS)  # a memory-bound step: a probe is cheap
    teach(policy, 1, num_drafts=30, k=4, num_accepted=0)
    plans, named_probes = [], []
    for _ in range(6 * PROBE_INTERVAL):
        plans.append(policy.plan([Candidate(1, 4)])[1])
        named_probes.append(policy.last_probes)
    assert set(plans) == {0, 1}
    # The plan names its probes (exploration apart from drafts it expects to pay).
    assert named_probes == [[1] if k else [] for k in plans]
    # The wait backs off: the first probe soon after drafting stopped, then sparser, then
    # one per PROBE_INTERVAL steps.
    probes = [step for step, k in enumerate(plans) if k]
    gaps = [later - earlier for earlier, later in zip(probes, probes[1:])]
    assert probes[0] < FIRST_PROBE_INTERVAL
    assert gaps == sorted(gaps) and gaps[0] < PROBE_INTERVAL and gaps[-3:] == [PROBE_INTERVAL] * 3
    # A probe that is accepted again brings drafting back.
    teach(policy, 1, num_drafts=20, k=1, num_accepted=1)
    assert policy.plan([Candidate(1, 4)])[1] > 0 and policy.last_probes == []


def test_idle_sequences_probe_together() -> None:
    """Sixteen sequences that stopped drafting, started at different steps: their probes
    share steps, so the drafter is asked once per wait (FIRST_PROBE_INTERVAL while they
    arrive, then PROBE_INTERVAL), and each is still probed."""
    policy = policy_with_cost(10 * MS, 0.05 * MS)
    candidates = [Candidate(seq_id, 4) for seq_id in range(16)]
    for candidate in candidates:
        teach(policy, candidate.seq_id, num_drafts=30, k=4, num_accepted=0)
    num_steps = 4 * PROBE_INTERVAL
    probed: dict[int, int] = {candidate.seq_id: 0 for candidate in candidates}
    steps_asking = []
    for step in range(num_steps):
        # Sequence i joins at step i: staggered, as requests arrive.
        plan = policy.plan([c for c in candidates if c.seq_id <= step])
        if any(plan.values()):
            steps_asking.append(step)
        for seq_id, k in plan.items():
            assert k in (0, 1)
            probed[seq_id] += k
    arriving = [step for step in steps_asking if step < 2 * PROBE_INTERVAL]
    settled = [step for step in steps_asking if step >= 2 * PROBE_INTERVAL]
    assert len(arriving) <= 2 * PROBE_INTERVAL // FIRST_PROBE_INTERVAL
    assert len(settled) <= (num_steps - 2 * PROBE_INTERVAL) // PROBE_INTERVAL
    assert min(probed.values()) >= 3


def test_dear_verification_spaces_probes_out() -> None:
    """Sixteen idle sequences on a compute-bound device (each verified token costs what the
    step's base does): probing each every PROBE_INTERVAL steps would cost 16 tokens' time
    every 16 steps, ~6% of the throughput. The waits grow until the probes cost at most
    PROBE_BUDGET of it; every sequence is still re-measured now and then."""
    policy = policy_with_cost(1 * MS, 1 * MS)
    candidates = [Candidate(seq_id, 4) for seq_id in range(16)]
    for candidate in candidates:
        teach(policy, candidate.seq_id, num_drafts=30, k=4, num_accepted=0)
    probed: dict[int, int] = {candidate.seq_id: 0 for candidate in candidates}
    num_steps = 4 * MAX_PROBE_INTERVAL
    for _ in range(num_steps):
        for seq_id, k in policy.plan(candidates).items():
            probed[seq_id] += k
    probe_seconds = sum(probed.values()) * 1 * MS
    plain_seconds = num_steps * (1 + len(candidates)) * MS
    assert probe_seconds <= PROBE_BUDGET * plain_seconds
    assert min(probed.values()) >= 2
    # The same sequences where a verified token is cheap probe every PROBE_INTERVAL steps.
    cheap = policy_with_cost(10 * MS, 0.05 * MS)
    for candidate in candidates:
        teach(cheap, candidate.seq_id, num_drafts=30, k=4, num_accepted=0)
    cheap_probes = sum(sum(cheap.plan(candidates).values()) for _ in range(num_steps))
    assert cheap_probes >= len(candidates) * (num_steps // PROBE_INTERVAL - 2)


def test_probes_stop_where_no_passage_could_pay() -> None:
    """Where a verified token costs more than a well-predicted draft adds (HOPEFUL_RATE),
    finding such a passage would gain nothing: the waits go to MAX_PROBE_INTERVAL. Where it
    costs a tenth of a token (one request on a memory-bound CPU), they stay PROBE_INTERVAL."""
    assert hopeful_share(3, HOPEFUL_RATE + 0.01) == 0.0
    assert hopeful_share(3, 0.0) == 1.0
    assert 0.8 < hopeful_share(3, 0.1) < 0.9
    dear = policy_with_cost(1 * MS, 1 * MS)  # 16 sequences: a token costs ~0.94 of one
    candidates = [Candidate(seq_id, 3) for seq_id in range(16)]
    for candidate in candidates:
        teach(dear, candidate.seq_id, num_drafts=30, k=3, num_accepted=0)
    plans = [dear.plan(candidates) for _ in range(2 * MAX_PROBE_INTERVAL)]
    probe_steps = [step for step, plan in enumerate(plans) if any(plan.values())]
    gaps = [later - earlier for earlier, later in zip(probe_steps, probe_steps[1:])]
    assert gaps and min(gaps) == MAX_PROBE_INTERVAL
    cheap = policy_with_cost(10 * MS, 1 * MS)  # one sequence: a token costs ~0.09 of one
    teach(cheap, 1, num_drafts=30, k=3, num_accepted=0)
    plans = [cheap.plan([Candidate(1, 3)])[1] for _ in range(6 * PROBE_INTERVAL)]
    probes = [step for step, k in enumerate(plans) if k]
    assert [later - earlier for earlier, later in zip(probes, probes[1:])][-3:] == [PROBE_INTERVAL] * 3


def test_a_new_sequence_is_probed_early_wherever_probes_are_dear() -> None:
    """On a step where probes are dear, a sequence never drafted for is still probed once
    the back-off (FIRST_PROBE_INTERVAL steps) passes: the engine-wide rates it starts from
    say nothing about whether its own text is predictable. Once asked, it is priced."""
    policy = policy_with_cost(1 * MS, 1 * MS)
    for seq_id in range(100, 116):
        teach(policy, seq_id, num_drafts=30, k=3, num_accepted=0)  # engine-wide rates: low
    candidates = [Candidate(seq_id, 3) for seq_id in range(16)]  # new sequences
    plans = [policy.plan(candidates) for _ in range(FIRST_PROBE_INTERVAL)]
    assert all(plans[-1][seq_id] == 1 for seq_id in range(16))
    assert not any(any(plan.values()) for plan in plans[:-1])
    for seq_id in range(16):
        policy.record_draft(seq_id, 1, 0, num_requested=1)
    later = [policy.plan(candidates) for _ in range(4 * PROBE_INTERVAL)]
    assert not any(any(plan.values()) for plan in later)


def first_probe_steps(policy: SpeculationPolicy, num_slots: int, lifetime: int, num_steps: int,
                      ) -> tuple[dict[int, tuple[int, int]], list[int]]:
    """Runs `num_slots` request slots, each request living `lifetime` steps, slot i's first
    starting at step i * lifetime / num_slots (requests arrive evenly). Returns per request
    (arrival step, first probe step) and the steps that asked the drafter for first probes
    alone; every ask proposes one rejected token."""
    first_probe: dict[int, tuple[int, int]] = {}
    lone_first_probe_steps: list[int] = []
    for step in range(num_steps):
        candidates = []
        for slot in range(num_slots):
            offset = step - slot * lifetime // num_slots
            if offset >= 0:
                seq_id = slot * 1000 + offset // lifetime
                candidates.append(Candidate(seq_id, 3))
                first_probe.setdefault(seq_id, (step - offset % lifetime, -1))
        asked = [seq_id for seq_id, k in policy.plan(candidates).items() if k]
        if asked and all(first_probe[seq_id][1] < 0 for seq_id in asked):
            lone_first_probe_steps.append(step)
        for seq_id in asked:
            if first_probe[seq_id][1] < 0:
                first_probe[seq_id] = (first_probe[seq_id][0], step)
            policy.record_draft(seq_id, 1, 0, num_requested=1)
    return first_probe, lone_first_probe_steps


def test_frequent_new_sequences_share_their_first_probes_round_trips() -> None:
    """Sixteen requests of 128 steps, a new one every 8 steps, a 1.2 ms round trip against a
    20 ms step (~6%). First probes on every FIRST_PROBE_INTERVAL-th step would ask the
    drafter for them alone on ~1 step in 8, ~0.7% of the throughput; they keep to every
    PROBE_INTERVAL-th step instead, and each new sequence is still probed."""
    policy = policy_with_cost(4 * MS, 1 * MS, draft_s=1.2 * MS)
    for seq_id in range(100_000, 100_016):
        teach(policy, seq_id, num_drafts=30, k=3, num_accepted=0)  # engine-wide rates: low
    first_probe, lone_steps = first_probe_steps(policy, num_slots=16, lifetime=128, num_steps=8 * 128)
    settled = [step for step in lone_steps if step >= 2 * 128]
    assert settled and all((step + 1) % PROBE_INTERVAL == 0 for step in settled)
    waits = [probed - arrived for arrived, probed in first_probe.values() if arrived >= 2 * 128 and probed >= 0]
    assert len(waits) >= 5 * 16 and max(waits) < FIRST_PROBE_INTERVAL + PROBE_INTERVAL


def test_one_request_at_a_time_is_probed_after_the_back_off() -> None:
    """Requests one after another arrive on ~1% of the steps: a round trip for each one's
    first probe is cheap over the run, so each is probed once its back-off has passed, on
    the next step of the finest grid (FIRST_PROBE_INTERVAL each)."""
    policy = policy_with_cost(10 * MS, 0.2 * MS, draft_s=1.2 * MS)
    for seq_id in range(100_000, 100_004):
        teach(policy, seq_id, num_drafts=30, k=3, num_accepted=0)
    first_probe, _ = first_probe_steps(policy, num_slots=1, lifetime=100, num_steps=6 * 100)
    waits = [probed - arrived for arrived, probed in first_probe.values()]
    assert len(waits) == 6 and max(waits) < 2 * FIRST_PROBE_INTERVAL


@pytest.mark.parametrize(("first_ask_s", "probed_early"), [(1.2 * MS, True), (6 * MS, False)])
def test_a_new_sequences_first_probe_is_priced_where_asking_is_dear(first_ask_s: float,
                                                                   probed_early: bool) -> None:
    """A round trip carrying first asks costs ~1 ms for ngram (token ids) but ~6 ms for
    EAGLE-3 (hidden states, then the head's passes) against a ~17 ms step of 16 sequences:
    ~1 token of the step's throughput against ~6. Below FREE_FIRST_ASK_TOKENS the first
    probe waits only for the back-off; above, it is priced like any probe, what the first
    ask adds included, and at sixteen sequences that wait outlasts these 64 steps."""
    policy = policy_with_cost(1 * MS, 1 * MS, draft_s=1 * MS)  # a steady round trip: 1 ms
    extra_s = first_ask_s - 1 * MS
    for num_first_asks in (1, 2, 1, 3, 1):
        policy.observe_first_asks(num_first_asks, 1, 1 * MS + num_first_asks * extra_s)
    round_trip, extra = policy.first_ask_costs()
    assert round_trip == pytest.approx(first_ask_s) and extra == pytest.approx(extra_s)
    candidates = [Candidate(seq_id, 3) for seq_id in range(16)]  # never asked
    plans = [policy.plan(candidates) for _ in range(4 * PROBE_INTERVAL)]
    first_probe_steps = {next((step for step, plan in enumerate(plans) if plan[seq_id]), None)
                         for seq_id in range(16)}
    if probed_early:
        assert first_probe_steps == {FIRST_PROBE_INTERVAL - 1}
    else:
        assert first_probe_steps == {None}


@pytest.mark.parametrize(("first_ask_extra_s", "drafts"), [(0.2 * MS, True), (30 * MS, False)])
def test_a_new_sequences_first_draft_pays_its_first_ask(first_ask_extra_s: float, drafts: bool) -> None:
    """One request, verification cheap: a new sequence drafts at once on the engine-wide
    rates, unless its first ask (a draft model's prefill of the context: ~28 ms here, three
    steps) costs more than its drafts could bring. Once asked, only steady costs count."""
    policy = policy_with_cost(10 * MS, 0.2 * MS, draft_s=1 * MS)
    for _ in range(5):
        policy.observe_first_asks(1, 4, 1 * MS + first_ask_extra_s)
    assert policy.first_ask_costs()[1] == pytest.approx(first_ask_extra_s)
    assert (policy.plan([Candidate(7, 4)])[7] > 0) == drafts
    policy.record_draft(7, 0, 0, num_requested=1)  # asked once (nothing proposed)
    policy.record_draft(7, 1, 1)
    assert policy.plan([Candidate(7, 4)])[7] > 0


def test_a_synced_sequences_first_draft_pays_no_first_ask() -> None:
    """A text drafter got the prompt as the prefill started (`Candidate.synced`): its first
    ask is a steady round trip, so a dear first ask measured for other sequences (that
    were not synced) does not keep it from drafting at once."""
    policy = policy_with_cost(10 * MS, 0.2 * MS, draft_s=1 * MS)
    for _ in range(5):
        policy.observe_first_asks(1, 4, 31 * MS)
    assert policy.plan([Candidate(7, 4)])[7] == 0
    assert policy.plan([Candidate(8, 4, synced=True)])[8] > 0


def test_one_slow_first_ask_does_not_price_the_rest() -> None:
    """The drafter's first call after start-up can take several times the next ones; first
    asks come about once a request, so the estimate is a median of recent ones."""
    policy = policy_with_cost(1 * MS, 1 * MS, draft_s=1 * MS)
    policy.observe_first_asks(8, 1, 80 * MS)  # start-up: 10 ms a first ask
    for _ in range(4):
        policy.observe_first_asks(1, 1, 1.1 * MS)
    assert policy.first_ask_costs()[1] == pytest.approx(0.1 * MS)


def test_an_overestimated_round_trip_is_measured_again() -> None:
    """Eight requests of 100 steps each. One slow round trip at start-up (40 ms against ~1)
    made every first ask dear, the first probes' priced waits outlived the requests, and
    with nobody asked the estimate was never corrected. After COST_REFRESH_PLANS plans
    without an ask one sequence is asked anyway; its round trip (a first ask, cheaper than
    the steady estimate) corrects the estimate, and new requests are probed again."""
    policy = SpeculationPolicy(3)
    for num_tokens in range(1, 17):
        policy.observe_verify(num_tokens, num_tokens % 4, 8 * MS + 1 * MS * num_tokens)
    policy.observe_drafting(1, 40 * MS)
    policy.observe_first_asks(8, 3, 42 * MS)
    for seq_id in range(1000, 1008):
        teach(policy, seq_id, num_drafts=30, k=3, num_accepted=0)  # engine-wide rates: low
    asked_at: list[int] = []
    asked_before: set[int] = set()
    for step in range(4 * COST_REFRESH_PLANS):
        generation = step // 100  # every request lives 100 steps
        candidates = [Candidate(generation * 8 + slot, 3) for slot in range(8)]
        plan = policy.plan(candidates)
        asked = [seq_id for seq_id, k in plan.items() if k]
        if not asked:
            continue
        asked_at.append(step)
        num_first = sum(1 for seq_id in asked if seq_id not in asked_before)
        if num_first:
            policy.observe_first_asks(num_first, 1, 1 * MS + 0.1 * MS * num_first)
        else:
            policy.observe_drafting(1, 1 * MS)
        for seq_id in asked:
            asked_before.add(seq_id)
            policy.record_draft(seq_id, 1, 0, num_requested=1)
    assert asked_at and asked_at[0] == COST_REFRESH_PLANS - 1
    assert policy.draft_cost.fit()[0] < 10 * MS
    assert len(asked_at) > 10  # once the estimate is right, new requests are probed again


def test_a_cheap_round_trip_with_first_asks_corrects_the_steady_estimate() -> None:
    """A round trip carrying first asks costs at least a steady one: one that took less
    shows the steady estimate too high."""
    policy = policy_with_cost(1 * MS, 1 * MS, draft_s=4 * MS)
    policy.observe_first_asks(1, 1, 1.2 * MS)
    assert policy.draft_cost.fit()[0] < 4 * MS
    steady_before = policy.draft_cost.fit()
    policy.observe_first_asks(1, 1, 30 * MS)  # dear: only the first-ask estimate takes it
    assert policy.draft_cost.fit() == steady_before


def test_a_drafter_that_proposes_nothing_stops_being_asked() -> None:
    """ngram finding no match returns no tokens: each ask cost a round trip for nothing."""
    policy = policy_with_cost(10 * MS, 0.2 * MS, draft_s=1.5 * MS)
    assert policy.plan([Candidate(1, 4)])[1] > 0  # the prior: worth asking
    for _ in range(10):
        policy.record_draft(1, 0, 0, num_requested=4)
    assert policy.plan([Candidate(1, 4)])[1] == 0
    # Not asked (k = 0 planned) and so nothing proposed: no evidence either way.
    fresh = policy_with_cost(10 * MS, 0.2 * MS, draft_s=1.5 * MS)
    for _ in range(10):
        fresh.record_draft(2, 0, 0, num_requested=0)
    assert fresh.plan([Candidate(2, 4)])[2] > 0


def test_a_drafter_that_rarely_proposes_but_is_right_keeps_being_asked() -> None:
    """ngram on text that repeats now and then: three asks in four find no match, the
    fourth proposes three tokens that are all accepted. An empty answer costs the round trip
    but no verification, so asking still pays where a verified token is dear to start."""
    policy = policy_with_cost(10 * MS, 0.2 * MS, draft_s=0.3 * MS, per_seq_s=3 * MS)
    for _ in range(8):
        for _ in range(3):
            policy.record_draft(1, 0, 0, num_requested=3)
        policy.record_draft(1, 3, 3, num_requested=3)
    assert 0.2 < policy.proposal_rate(1) < 0.4
    assert policy.plan([Candidate(1, 3)])[1] > 0


def test_forget_drops_a_sequence() -> None:
    policy = policy_with_cost(1 * MS, 1 * MS)
    teach(policy, 1, num_drafts=30, k=4, num_accepted=4)
    policy.forget(1)
    assert 1 not in policy._stats


def test_a_plan_without_drafts_says_why_with_its_figures() -> None:
    # 16 sequences whose drafts are never accepted: nobody drafts, and each is told why.
    policy = policy_with_cost(5 * MS, 1 * MS)
    for seq_id in range(16):
        teach(policy, seq_id, num_drafts=30, k=4, num_accepted=0)
    plan = policy.plan([Candidate(seq_id, 4) for seq_id in range(16)])
    assert not any(plan.values())
    reason = policy.step_off_reason
    assert reason.startswith("off: a draft is expected to add at most 0.")
    assert "at batch size 16" in reason
    assert policy.off_reasons == dict.fromkeys(range(16), reason)


def test_a_request_left_out_of_a_drafting_plan_is_told_why() -> None:
    policy = policy_with_cost(5 * MS, 1 * MS)
    for seq_id in range(16):
        teach(policy, seq_id, num_drafts=30, k=4, num_accepted=4 if seq_id < 4 else 0)
    policy.plan([Candidate(seq_id, 4) for seq_id in range(16)])
    assert policy.step_off_reason == ""  # the step drafts
    assert set(policy.off_reasons) == set(range(4, 16))
    assert policy.off_reasons[4].startswith("off for this request: a draft is expected to add 0.")


def test_drafting_that_realized_less_than_plain_steps_is_named_with_its_yield() -> None:
    policy = policy_with_cost(5 * MS, 1 * MS)
    teach(policy, 0, num_drafts=30, k=4, num_accepted=MIXED)
    # Plain steps of one sequence at their predicted time, drafting steps at 0.6 of theirs.
    plain_s = policy.verify_cost.fit()[0] + policy.verify_cost.fit()[1]
    for _ in range(20):
        policy.realized.observe(1, False, 1, plain_s, plain_s)
    for _ in range(300):
        policy.realized.observe(1, True, 3, 5 * plain_s, plain_s)
    plan = policy.plan([Candidate(0, 4)])
    assert plan == {0: 0}
    assert policy.step_off_reason == "off: drafting yields 0.60x plain decoding at batch size 1"
    assert policy.off_reasons == {0: policy.step_off_reason}
