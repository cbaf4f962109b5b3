"""The per-token confidence that the text-matching drafters (ngram, suffix) send with a draft.

Both draft by finding the context's last m tokens earlier (in the request, or in earlier
answers) and copying what followed. For a draft token the evidence is m (for the i-th
draft token, the match plus the i draft tokens before it) and, among the earlier
occurrences of that text that go on at all, how many go on with this token (a) of how many
(t). The estimate is a Beta-Bernoulli posterior mean with one pseudo-count at a prior that
grows with the match length, p(m) = 1 - 2**-m, times the agreeing share a / t once more
where the occurrences disagree:

    confidence = (a + p(m)) / (t + 1) * (a / t)

An offline study here measured 0.93-1.00 acceptance for a 5-gram seen twice with one
continuation (this gives 0.99) and 0.02-0.25 where the continuations disagree (1 of 2:
0.33, 1 of 3: 0.16): text that went on in several ways is unpredictable, not merely split.
A 1-gram seen once gives 0.75. It ranks evidence and is not calibrated: a policy should
map it to the acceptance it measures (SequenceDraft.confidence: "the proposer's estimate
that the token is accepted given the ones before it").
"""

from __future__ import annotations


def match_confidence(num_agree: int, num_total: int, match_len: int) -> float:
    """In [0, 1]; 0 when no occurrence goes on (num_total 0) or none agrees."""
    if num_total <= 0 or num_agree <= 0:
        return 0.0
    prior = 1.0 - 0.5 ** max(match_len, 0)
    return min(1.0, (num_agree + prior) / (num_total + 1) * num_agree / num_total)
