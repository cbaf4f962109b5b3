"""verifier_svc.speculation.evidence: drafts verified as far as their own evidence pays."""

from __future__ import annotations

import random

import pytest

from verifier_svc.speculation.evidence import (
    BIN_EDGES,
    PRIOR_WEIGHT,
    ConfidenceCalibration,
    verified_lengths,
)
from verifier_svc.speculation.policy import SpeculationPolicy

MS = 1e-3


def test_an_unseen_confidence_is_its_own_estimate() -> None:
    calibration = ConfidenceCalibration()
    assert calibration.rate(0.3) == pytest.approx(0.3)
    assert calibration.rate(0.99) == pytest.approx(0.99)


def test_calibration_counts_accepted_and_the_rejected_token_only() -> None:
    """Accepted tokens and the first rejected one were tested; the ones after it were not."""
    calibration = ConfidenceCalibration()
    calibration.record([0.99, 0.99, 0.5, 0.1], num_accepted=1)  # 0.99 yes, 0.99 no; rest untested
    assert sum(calibration.reached) == pytest.approx(2.0)
    assert sum(calibration.accepted) == pytest.approx(1.0)
    top = len(BIN_EDGES)
    assert calibration.reached[top] == pytest.approx(2.0) and calibration.accepted[top] == pytest.approx(1.0)
    # (1 accepted + PRIOR_WEIGHT * 0.99) / (2 reached + PRIOR_WEIGHT)
    assert calibration.rate(0.99) == pytest.approx((1 + PRIOR_WEIGHT * 0.99) / (2 + PRIOR_WEIGHT))


@pytest.mark.parametrize(("confidence", "true_rate"), [(0.95, 0.3), (0.5, 0.9), (0.99, 0.99)])
def test_calibration_learns_what_a_confidence_achieves(confidence: float, true_rate: float) -> None:
    """The drafters' confidence ranks evidence; what it is worth is measured: a bin whose
    tokens are accepted at `true_rate` comes to be estimated there, whatever it claimed."""
    rng = random.Random(0)
    calibration = ConfidenceCalibration()
    for _ in range(3000):
        accepted = 0
        while accepted < 4 and rng.random() < true_rate:
            accepted += 1
        calibration.record([confidence] * 4, accepted)
    assert calibration.rate(confidence) == pytest.approx(true_rate, abs=0.06)


@pytest.mark.parametrize(("rates", "base_ms", "token_ms", "first_ms", "expected"), [
    # One request, flat verification (CPU): every token a strong draft offers.
    ([[0.95] * 8], 10.0, 0.2, 0.0, [8]),
    # The same draft where a verified row costs half a step: it stops at 6, where
    # p_6 = 0.74 of a token would cost more than the step's 0.76 tokens per row.
    ([[0.95] * 8], 10.0, 5.0, 0.0, [5]),
    # A weak draft: nothing where rows are dear, the first tokens where they are cheap.
    ([[0.3] * 8], 10.0, 5.0, 0.0, [0]),
    ([[0.3] * 8], 10.0, 0.5, 0.0, [2]),
    # A strong first token then a weak tail: cut where the evidence breaks.
    ([[0.99, 0.99, 0.99, 0.2, 0.2]], 10.0, 1.0, 0.0, [3]),
    # Sixteen sequences, compute-bound (5 ms + 1 ms a row): only the drafts that keep
    # being right verify.
    ([[0.98] * 6] + [[0.4] * 6] * 15, 21.0, 1.0, 0.0, [6] + [0] * 15),
    # A sequence's first row dearer than its next ones: a weak draft does not start.
    ([[0.99] * 4, [0.5] * 4], 30.0, 0.5, 8.0, [4, 0]),
])
def test_verified_lengths_maximise_expected_tokens_per_second(rates, base_ms, token_ms, first_ms,
                                                              expected) -> None:
    num_plain = len(rates)
    lengths = verified_lengths(rates, num_plain, base_ms * MS, token_ms * MS, first_ms * MS)
    assert lengths == expected

    def throughput(lengths: list[int]) -> float:
        tokens, seconds = float(num_plain), base_ms * MS
        for draft, length in zip(rates, lengths):
            p = 1.0
            for rate in draft[:length]:
                p *= rate
                tokens += p
            seconds += length * token_ms * MS + (first_ms * MS if length else 0.0)
        return tokens / seconds

    # No single draft one token longer or shorter does better.
    best = throughput(lengths)
    for index, draft in enumerate(rates):
        for delta in (-1, 1):
            other = list(lengths)
            other[index] += delta
            if 0 <= other[index] <= len(draft):
                assert throughput(other) <= best + 1e-12


def test_the_policy_verifies_everything_until_a_step_was_timed_then_by_evidence() -> None:
    policy = SpeculationPolicy(8)
    strong, weak = [0.99] * 8, [0.3] * 8
    assert policy.evidence_lengths([strong, weak], 2, 0, 1 * MS) == [8, 8]
    for num_tokens in range(1, 17):  # a compute-bound step: 5 ms + 2 ms a token
        policy.observe_verify(num_tokens, num_tokens % 3, 5 * MS + 2 * MS * num_tokens)
    strong_len, weak_len = policy.evidence_lengths([strong, weak], 2, 0, 1 * MS)
    assert strong_len > 2 and weak_len == 0
    # Drafts of that "strong" confidence keep failing: calibrated, it verifies less.
    for _ in range(200):
        policy.record_confidence(strong, 0)
    assert policy.evidence_lengths([strong], 1, 0, 1 * MS) == [0]
