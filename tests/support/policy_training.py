"""Speculation policies taught step costs and acceptance by hand, for the policy's own tests
and for engines whose policy must already know that drafting does not pay."""

from __future__ import annotations

from verifier_svc.speculation.policy import SpeculationPolicy

MS = 1e-3
STEP_S = 0.010
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def policy_with_cost(base_s: float, per_token_s: float, k: int = 4,
                     draft_s: float = 0.0, per_seq_s: float = 0.0) -> SpeculationPolicy:
    """A policy that has measured T(N, S) = base + per_token * N + per_seq * S over
    N = 1..16 tokens, S = 0..3 sequences with drafts."""
    policy = SpeculationPolicy(k)
    for num_tokens in range(1, 17):
        num_seqs = num_tokens % 4
        policy.observe_verify(num_tokens, num_seqs,
                              base_s + per_token_s * num_tokens + per_seq_s * num_seqs)
        policy.observe_drafting(1 + num_tokens % k, draft_s)
    return policy


def teach(policy: SpeculationPolicy, seq_id: int, num_drafts: int, k: int,
          num_accepted: int | tuple[int, ...]) -> None:
    pattern = num_accepted if isinstance(num_accepted, tuple) else (num_accepted,)
    for index in range(num_drafts):
        policy.record_draft(seq_id, k, pattern[index % len(pattern)])


def measured_that_drafting_does_not_pay(policy: SpeculationPolicy) -> None:
    for num_tokens in range(1, 17):
        policy.observe_verify(num_tokens, num_tokens % 4, STEP_S + 0.001 * num_tokens)
        policy.observe_drafting(1 + num_tokens % 3, 0.001)
    for _ in range(200):
        policy.record_draft(-1, 3, 0)  # the engine-wide prior: nothing is accepted
    for _ in range(20):
        policy.realized.observe(1, False, 1, STEP_S, STEP_S)
    for _ in range(300):
        policy.realized.observe(1, True, 2, 4 * STEP_S, STEP_S)
