"""verifier_svc/speculation/realized.py: drafting's cost scaled by what drafting steps realize
against plain steps of their size, and the policy drafting less when they realize less."""

from __future__ import annotations

import pytest

from verifier_svc.speculation.candidate import Candidate
from verifier_svc.speculation.policy import SpeculationPolicy
from verifier_svc.speculation.realized import (
    MAX_SCALE,
    MIN_STEPS,
    RealizedThroughput,
    bucket,
)


@pytest.mark.parametrize("num_seqs, expected", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3),
                                                (9, 4), (16, 4), (17, 5)])
def test_buckets_double(num_seqs, expected) -> None:
    assert bucket(num_seqs) == expected


def _plain_steps(realized: RealizedThroughput, num_seqs: int, count: int,
                 seconds: float = 0.020, predicted: float = 0.016) -> None:
    for _ in range(count):
        realized.observe(num_seqs, False, num_seqs, seconds, predicted)


def _losing(num_drafting_steps: int) -> RealizedThroughput:
    """Plain steps at 16 sequences (16 tokens in 20 ms: 800 tokens/s), then drafting steps
    yielding 20 tokens in 40 ms (500 tokens/s)."""
    realized = RealizedThroughput()
    _plain_steps(realized, 16, MIN_STEPS)
    for _ in range(num_drafting_steps):
        realized.observe(16, True, 20, 0.040, 0.016)
    return realized


def test_the_scale_rises_while_drafting_steps_yield_less_than_plain_ones() -> None:
    realized = _losing(200)
    assert realized.efficiency(16) == pytest.approx(0.625)
    assert realized.cost_scale(16) == pytest.approx(MAX_SCALE)  # bounded
    assert realized.cost_scale(12) == realized.cost_scale(16)   # the same bucket
    assert realized.cost_scale(4) == 1.0                        # another bucket: untouched


def test_the_scale_falls_back_to_one_while_drafting_pays() -> None:
    realized = _losing(40)
    raised = realized.cost_scale(16)
    assert raised > 1.5
    for _ in range(400):                    # 48 tokens in 40 ms: 1.5x plain
        realized.observe(16, True, 48, 0.040, 0.016)
    assert realized.efficiency(16) > 1.0
    assert realized.cost_scale(16) == 1.0


def test_drafting_is_judged_against_plain_steps_of_its_own_size() -> None:
    # Plain steps at 16 sequences, drafting steps at 9 in the same bucket: 9 sequences take
    # less time, so raw tokens/s would call 9 tokens in 12 ms (750/s) a loss against 800/s.
    # Against what plain steps of 9 take (the prediction, times the plain steps' overrun of
    # it: 0.009 * 1.25 = 11.25 ms), 9 + 3 tokens in 12 ms is a gain, and the scale stays 1.
    realized = RealizedThroughput()
    _plain_steps(realized, 16, MIN_STEPS)
    for _ in range(100):
        realized.observe(9, True, 12, 0.012, 0.009)
    assert realized.efficiency(9) == pytest.approx(12 / (9 * 0.012 / 0.01125))
    assert realized.cost_scale(9) == 1.0


def test_plain_steps_relax_the_scale_so_drafting_is_tried_again() -> None:
    # A high scale stops the drafting whose steps would lower it: plain steps bring it back.
    realized = _losing(200)
    assert realized.cost_scale(16) == pytest.approx(MAX_SCALE)
    _plain_steps(realized, 16, 140)
    assert 1.0 < realized.cost_scale(16) < MAX_SCALE ** 0.55
    _plain_steps(realized, 16, 1000)
    assert realized.cost_scale(16) < 1.01


def test_nothing_moves_before_both_kinds_of_step_were_seen() -> None:
    realized = RealizedThroughput()
    for _ in range(100):  # one request that always drafts: no plain step to compare with
        realized.observe(1, True, 1, 0.040, 0.010)
    assert realized.cost_scale(1) == 1.0 and realized.efficiency(1) is None
    _plain_steps(realized, 1, MIN_STEPS - 1)
    realized.observe(1, True, 1, 0.040, 0.010)
    assert realized.cost_scale(1) == 1.0


def _fitted_policy() -> SpeculationPolicy:
    policy = SpeculationPolicy(4)
    for num_tokens in (16, 24, 32, 48, 16, 40):  # 10 ms + 0.5 ms a token
        policy.observe_verify(num_tokens, 0, 0.010 + 0.0005 * num_tokens)
    for longest in (1, 2, 4):
        policy.observe_drafting(longest, 0.001)
    for seq_id in range(16):  # drafts accepted about 3 times in 4
        for _ in range(6):
            policy.record_draft(seq_id, 4, 3, 4)
    return policy


def test_the_policy_drafts_less_once_drafting_steps_realize_less() -> None:
    candidates = [Candidate(seq_id, 4, synced=True) for seq_id in range(16)]
    policy = _fitted_policy()
    before = sum(policy.plan(candidates).values())
    assert before > 16
    for _ in range(MIN_STEPS):
        policy.observe_step(16, False, 16, 0.020)
    for _ in range(200):
        policy.observe_step(16, True, 20, 0.060)
    assert policy.realized.cost_scale(16) > 2.0
    after = sum(policy.plan(candidates).values())
    assert after < before
    lengths_before = _fitted_policy().evidence_lengths([[0.8] * 4] * 16, 16, 0, 0.001)
    lengths_after = policy.evidence_lengths([[0.8] * 4] * 16, 16, 0, 0.001)
    assert sum(lengths_after) < sum(lengths_before)
