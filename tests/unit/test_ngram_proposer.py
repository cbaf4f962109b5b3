"""Table tests of the n-gram matcher (vLLM v1's rule), plus a check against a KMP oracle."""

from __future__ import annotations

import time

import numpy as np
import pytest

from drafter_svc.ngram_proposer import NgramProposer
from drafter_svc.proposer import NgramMethod, TokenHistory
from specdec.config import SpeculativeConfig

CASES = [
    # (name, context, min_n, max_n, k, expected)
    ("basic match", [1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ("basic match, k caps", [1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ("unigram match", [1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ("longest n wins over shorter", [2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),
    ("3-gram beats earlier 2-gram", [3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),
    ("no 4-gram, 3-gram matches", [1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ("earliest occurrence chosen", [1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3],
     3, 3, 2, [100, 1]),
    ("earliest unigram occurrence", [1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),
    ("match right before the end", [5, 6, 7, 8, 9, 9], 1, 3, 3, [9]),
    ("bigram right before the end", [5, 1, 2, 1, 2], 2, 2, 3, [1, 2]),
    ("fewer than k tokens after the match", [7, 1, 2, 8, 1, 2], 2, 2, 5, [8, 1, 2]),
    ("context shorter than min", [1, 1], 3, 5, 3, []),
    ("empty context", [], 1, 3, 3, []),
    ("single token", [4], 1, 1, 3, []),
    ("no match", [1, 2, 3, 4, 5], 2, 2, 2, []),
    ("only a shorter match than min", [1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ("no 4-gram at min == max", [1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ("min == max", [9, 8, 7, 9, 8, 6, 9, 8], 2, 2, 2, [7, 9]),
    ("repeated single token run", [5, 5, 5, 5, 5, 5], 2, 3, 4, [5, 5, 5]),
    ("run after other tokens", [1, 2, 5, 5, 5, 5], 1, 2, 3, [5, 5]),
    ("max_n longer than the context", [1, 2, 1, 2], 1, 10, 3, [1, 2]),
    ("k = 0", [1, 2, 3, 1, 2], 1, 2, 0, []),
]


@pytest.mark.parametrize("name,context,min_n,max_n,k,expected", CASES,
                         ids=[case[0] for case in CASES])
def test_matcher_table(name, context, min_n, max_n, k, expected):
    proposer = NgramProposer(min_n, max_n, num_speculative_tokens=max(k, 1))
    assert proposer.propose(context, k) == expected
    assert proposer.propose(np.asarray(context, dtype=np.int64), k) == expected


def test_num_tokens_never_exceeds_configured_k():
    proposer = NgramProposer(1, 2, num_speculative_tokens=2)
    assert proposer.propose([1, 2, 3, 4, 5, 1], 10) == [2, 3]


def _kmp_oracle(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's algorithm spelled out: prefix function over the reversed context, capped at max_n."""
    total = len(tokens)
    if total < min_n or k <= 0:
        return []
    reversed_tokens = tokens[::-1]
    lps = [0] * max_n
    longest, position, prev, i = 0, 0, 0, 1
    while i < total:
        if reversed_tokens[prev] == reversed_tokens[i]:
            prev += 1
            if prev >= longest:  # >=: the latest position reversed = the earliest original
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start:start + k]


def test_matches_kmp_oracle_on_random_contexts():
    rng = np.random.default_rng(0)
    num_nonempty = 0
    for _ in range(3000):
        vocab = int(rng.integers(2, 6))
        context = rng.integers(0, vocab, size=int(rng.integers(0, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        expected = _kmp_oracle(context, min_n, max_n, k)
        num_nonempty += bool(expected)
        assert NgramProposer(min_n, max_n, k).propose(context, k) == expected, (
            context, min_n, max_n, k)
    assert num_nonempty > 1000  # the comparison exercised real matches


def test_long_context_cost():
    """Prints the per-call cost on a 4k-token context (no timed assertion)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 32000, size=4096)
    tokens[-64:] = tokens[1000:1064]
    proposer = NgramProposer(3, 5, 5)
    assert proposer.propose(tokens, 5) == tokens[1064:1069].tolist()
    start = time.perf_counter()
    for _ in range(200):
        proposer.propose(tokens, 5)
    print(f"ngram propose on 4096 tokens: {(time.perf_counter() - start) / 200 * 1e6:.1f} us")


def test_token_history_grows_and_keeps_tokens():
    history = TokenHistory(initial_capacity=16)
    expected: list[int] = []
    for chunk in ([1, 2, 3], list(range(40)), [], [7] * 100):
        history.extend(chunk)
        expected += chunk
    assert len(history) == len(expected)
    assert history.view().tolist() == expected


def test_ngram_method_state():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                     '"prompt_lookup_min": 1, "prompt_lookup_max": 2}')
    method = NgramMethod.from_config(config)
    assert method.context_len(1) is None
    method.add_sequence(1)
    method.append_tokens(1, [1, 2, 3], None)
    method.append_tokens(1, [1, 2], None)
    method.rollback(1, 2)  # no draft state: a no-op
    assert method.context_len(1) == 5
    assert [p.draft_token_ids for p in method.propose([1], [10])] == [[3, 1, 2]]
    method.remove_sequence(1)
    method.remove_sequence(1)
    assert method.context_len(1) is None
