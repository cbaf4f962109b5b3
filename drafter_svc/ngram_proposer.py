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
        num_tokens = min(num_tokens, self.num_speculative_tokens)
        tokens = np.asarray(token_ids)
        context_len = tokens.shape[0]
        if num_tokens <= 0 or context_len < max(self.prompt_lookup_min, 2):
            return []
        match_end = self._earliest_longest_match_end(tokens)
        if match_end is None:
            return []
        start = match_end + 1
        return tokens[start:start + num_tokens].tolist()

    def _earliest_longest_match_end(self, tokens: np.ndarray) -> int | None:
        """End index of the earliest occurrence of the longest matching suffix n-gram."""
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
        return int(candidates[0])
