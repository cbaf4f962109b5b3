"""Prompt-lookup (n-gram) drafting with vLLM v1's matching rule.

The drafter looks for the current context's suffix earlier in the same context and
proposes the tokens that followed it. Rule (vLLM `_find_longest_matched_ngram_and_propose_tokens`):

- n ranges over [prompt_lookup_min, prompt_lookup_max]; the longest n whose suffix
  occurs earlier wins (an earlier occurrence may overlap the suffix, but is never the
  suffix itself);
- among the occurrences of that n-gram the EARLIEST one is used;
- the proposal is up to k tokens that followed it, fewer when the context ends sooner;
  nothing when no n >= prompt_lookup_min matches.

Worked example, min = max = 2, k = 3, context [1, 2, 3, 4, 1, 2, 3]: the suffix (2, 3)
occurs at positions 1..2; the tokens after it are [4, 1, 2].

The search narrows a candidate set instead of running KMP in Python: the positions whose
token equals the last token (one vectorised comparison over the context), then for each
further n the candidates whose token n - 1 places back also matches. The first step is
O(len(context)) in numpy; later steps touch only surviving candidates, which shrink fast
on real text. Cost for a few thousand tokens is tens of microseconds.

Confidence (`propose_with_confidence`, SequenceDraft.confidence): for draft token i, the
match length is n + i and the occurrences are those of the matched n-gram whose
continuation agreed with the draft's first i tokens; drafter_svc/confidence.py turns that
into an estimate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Stateless matcher: `propose(token_ids, num_tokens)` -> up to k draft token ids."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int,
                 num_speculative_tokens: int) -> None:
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({prompt_lookup_min})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: Sequence[int] | np.ndarray, num_tokens: int) -> list[int]:
        """Draft token ids for the context `token_ids`; at most min(num_tokens, k) of them."""
        tokens = np.asarray(token_ids)
        match = self._match(tokens, num_tokens)
        if match is None:
            return []
        candidates, _ = match
        start = int(candidates[0]) + 1  # the earliest occurrence
        return tokens[start:start + min(num_tokens, self.num_speculative_tokens)].tolist()

    def propose_with_confidence(self, token_ids: Sequence[int] | np.ndarray, num_tokens: int,
                                ) -> tuple[list[int], list[float]]:
        """`propose`'s draft and one confidence per token (see the module docstring)."""
        tokens = np.asarray(token_ids)
        match = self._match(tokens, num_tokens)
        if match is None:
            return [], []
        candidates, matched_n = match
        start = int(candidates[0]) + 1
        draft = tokens[start:start + min(num_tokens, self.num_speculative_tokens)]
        num_draft = draft.shape[0]
        if candidates.size == 1:
            # Only the draft's own occurrence (the usual case): it goes on with every token,
            # and match_confidence(1, 1, m) is 1 - 2**-(m + 1).
            return draft.tolist(), [1.0 - 0.5 ** (matched_n + i + 1) for i in range(num_draft)]
        # [occurrence, draft position]: whether the occurrence goes on that far, and whether
        # it agreed with the draft up to and including that position.
        positions = candidates[:, None] + 1 + np.arange(num_draft)
        goes_on = positions < tokens.shape[0]
        following = tokens[np.minimum(positions, tokens.shape[0] - 1)]
        agreed = np.cumprod((following == draft) & goes_on, axis=1).astype(bool)
        consistent = np.concatenate(
            [np.ones((candidates.size, 1), dtype=bool), agreed[:, :-1]], axis=1)
        num_total = (consistent & goes_on).sum(axis=0)
        num_agree = agreed.sum(axis=0)
        # match_confidence, vectorised (num_total >= num_agree >= 1: the draft's own
        # occurrence agrees all along).
        prior = 1.0 - 0.5 ** (matched_n + np.arange(num_draft))
        confidence = ((num_agree + prior) / (num_total + 1) * num_agree / num_total).tolist()
        return draft.tolist(), confidence

    def _match(self, tokens: np.ndarray, num_tokens: int) -> tuple[np.ndarray, int] | None:
        """(ends of every earlier occurrence of the longest matching suffix n-gram, sorted;
        n), or None when nothing is to be drafted."""
        if (min(num_tokens, self.num_speculative_tokens) <= 0
                or tokens.shape[0] < max(self.prompt_lookup_min, 2)):
            return None
        return self._longest_match(tokens)

    def _longest_match(self, tokens: np.ndarray) -> tuple[np.ndarray, int] | None:
        """Ends of the occurrences of the longest matching suffix n-gram, and its n."""
        context_len = tokens.shape[0]
        last = context_len - 1
        # Candidate ends j < last: tokens[j - n + 1 .. j] == tokens[last - n + 1 .. last].
        candidates = np.flatnonzero(tokens[:last] == tokens[last])
        if candidates.size == 0:
            return None
        matched_n = 1
        max_n = min(self.prompt_lookup_max, context_len - 1)
        for n in range(2, max_n + 1):
            back = n - 1
            # Occurrences must start inside the context: j - back >= 0. Candidates are sorted.
            usable = candidates[np.searchsorted(candidates, back):]
            survivors = usable[tokens[usable - back] == tokens[last - back]]
            if survivors.size == 0:
                break
            candidates = survivors
            matched_n = n
        if matched_n < self.prompt_lookup_min:
            return None
        # Sorted ascending, so the first survivor is the earliest occurrence.
        return candidates, matched_n
