"""Tree verification: greedy follows the target's argmax chain through the tree; sampling
keeps the target's distribution (chi-square over many draws, drafts from another
distribution) and a seeded request's tokens whatever the tree."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.draft_tree import (
    chain_confidence,
    check_parents,
    depths,
    main_branch,
    path_confidence,
    segment_parents,
)
from specdec.engine.position_random import PositionRandom
from specdec.engine.rejection_sampler import verify
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.tree_sampler import verify_tree
from tests.support.chi_square import chi_square_p_value

GREEDY = SamplingParams(temperature=0.0)
VOCAB_SIZE = 6
NUM_SAMPLES = 12_000
MIN_P_VALUE = 1e-3


def _rows_with_argmax(argmax_ids: list[int], vocab_size: int = 16) -> torch.Tensor:
    logits = torch.linspace(-1.0, 1.0, vocab_size).repeat(len(argmax_ids), 1)
    for row, token_id in enumerate(argmax_ids):
        logits[row, token_id] = 5.0
    return logits


def test_tree_helpers() -> None:
    parents = [-1, 0, 1, -1, 3, 0]
    assert check_parents(parents, 6) is None
    assert check_parents([-1, 1], 2) is not None and check_parents([-1], 2) is not None
    assert depths(parents) == [1, 2, 3, 1, 2, 2]
    assert main_branch(parents) == [0, 1, 2] and main_branch([-1, -1, 1, 0]) == [0, 3]
    # One chunk token (the root) then the nodes; two chunk tokens shift them by one.
    assert segment_parents(1, [-1, 0, -1]) == [-1, 0, 1, 0]
    assert segment_parents(2, [-1, 0, -1]) == [-1, 0, 1, 2, 1]
    # Path probabilities 0.8, 0.4, 0.5, 0.1: each value the ratio to the one before.
    assert chain_confidence([-1, 0, -1, 2], [0.8, 0.5, 0.5, 0.2]) == pytest.approx([0.8, 0.5, 1.0, 0.2])
    assert path_confidence([-1, 0, -1, 2], [0.8, 0.5, 0.5, 0.2], [2]) == [0.5, 0.2]
    assert path_confidence([-1, 0, -1, 2], [0.8, 0.5, 0.5, 0.2], []) == [0.8]


# Root children 3 (node 0) and 7 (node 2); node 0 -> 4 (node 1), node 2 -> 9 (node 3), 8 (node 4).
TREE_TOKENS = [3, 4, 7, 9, 8]
TREE_PARENTS = [-1, 0, -1, 2, 2]


@pytest.mark.parametrize(("argmax_ids", "expected", "path"), [
    ([7, 0, 0, 9, 0, 0], [7, 9, 0], [2, 3]),  # the second branch, its first child, bonus 0
    ([7, 0, 0, 8, 0, 5], [7, 8, 5], [2, 4]),  # node 2's second child, then node 4's bonus
    ([3, 4, 11, 0, 0, 0], [3, 4, 11], [0, 1]),  # the main branch, then node 1's bonus
    ([5, 4, 11, 9, 0, 0], [5], []),  # no child of the root holds 5: recovered at once
])
def test_greedy_follows_the_argmax_chain(argmax_ids: list[int], expected: list[int], path: list[int]) -> None:
    logits = _rows_with_argmax(argmax_ids)
    verdict = verify_tree(logits, TREE_TOKENS, TREE_PARENTS, [1, 2], GREEDY, None)
    assert (verdict.token_ids, verdict.path) == (expected, path)
    only_argmax = verify_tree(logits, TREE_TOKENS, TREE_PARENTS, [1, 2], GREEDY, None,
                              target_argmax_ids=argmax_ids)
    assert (only_argmax.token_ids, only_argmax.path) == (expected, path)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_with_penalties_equals_the_flat_verify_of_its_path(seed: int) -> None:
    """Each row is processed with its own path as context: the result is the flat verify
    of the path the tree walk took (penalties that move the argmax included)."""
    generator = torch.Generator().manual_seed(seed)
    parents = [-1, 0, -1, 2, 1, -1, 5]
    tokens = torch.randint(0, 5, (len(parents),), generator=generator).tolist()
    logits = torch.randn(len(parents) + 1, 5, generator=generator)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, presence_penalty=0.7)
    history = [1, 3, 0]
    verdict = verify_tree(logits, tokens, parents, history, params, None, prompt_len=2)
    rows = [0] + [1 + node for node in verdict.path]
    flat = verify(logits[rows], [tokens[node] for node in verdict.path], history, params, None, prompt_len=2)
    assert verdict.token_ids == flat


def _draft_tree(generator: torch.Generator, draft_probs: torch.Tensor, num_branches: int) -> list[int]:
    """Distinct root children drawn from draft_probs (without replacement), each with one
    child drawn from it too: tokens of nodes 0, 2, 4, ... (children of the root) and 1, 3, ..."""
    branch_tokens = torch.multinomial(draft_probs, num_branches, replacement=False, generator=generator)
    tokens = []
    for token in branch_tokens.tolist():
        tokens += [token, int(torch.multinomial(draft_probs, 1, generator=generator))]
    return tokens


@pytest.mark.parametrize("num_branches", [1, 3])
def test_sampled_tree_keeps_the_target_distribution(num_branches: int) -> None:
    """The first emitted token is distributed as the root row's target, and the second (when
    the first was a draft) as its node's row's target, though the branches' tokens come from
    a distribution far from the target's."""
    target_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    draft_probs = torch.tensor([0.02, 0.03, 0.05, 0.2, 0.3, 0.4])
    params = SamplingParams(temperature=0.8)
    target_probs = (target_logits / 0.8).softmax(-1)
    parents = [-1, 0] * num_branches
    for index in range(1, len(parents), 2):
        parents[index] = index - 1
    logits = target_logits.repeat(len(parents) + 1, 1)
    draft_generator = torch.Generator().manual_seed(num_branches)
    sample_generator = torch.Generator().manual_seed(100 + num_branches)
    first = torch.zeros(VOCAB_SIZE)
    second = torch.zeros(VOCAB_SIZE)
    num_accepted = 0
    for _ in range(NUM_SAMPLES):
        tokens = _draft_tree(draft_generator, draft_probs, num_branches)
        verdict = verify_tree(logits, tokens, parents, [], params, sample_generator)
        first[verdict.token_ids[0]] += 1
        if verdict.path:
            num_accepted += 1
            second[verdict.token_ids[1]] += 1
            assert tokens[verdict.path[0]] == verdict.token_ids[0]
    assert chi_square_p_value(first, target_probs) > MIN_P_VALUE
    assert chi_square_p_value(second, target_probs) > MIN_P_VALUE
    assert num_accepted > NUM_SAMPLES // 40  # enough second tokens to test


def test_taking_the_first_branch_unchecked_fails_the_same_check() -> None:
    """Negative control: emitting the first branch's token as if always accepted gives the
    draft's distribution, which the check above refuses."""
    target_probs = (torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0]) / 0.8).softmax(-1)
    draft_probs = torch.tensor([0.02, 0.03, 0.05, 0.2, 0.3, 0.4])
    generator = torch.Generator().manual_seed(5)
    counts = torch.bincount(torch.multinomial(draft_probs, 2000, replacement=True, generator=generator),
                            minlength=VOCAB_SIZE).double()
    assert chi_square_p_value(counts, target_probs) < MIN_P_VALUE


@pytest.mark.parametrize("seed", range(5))
def test_seeded_tokens_do_not_depend_on_the_tree(seed: int) -> None:
    """A seeded request draws its token at output position p from (seed, p) alone: with
    equal rows, a tree yields the tokens decoding one at a time yields, up to where it
    stops."""
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, seed=seed)
    row = torch.randn(VOCAB_SIZE, generator=generator)
    parents = [-1, 0, 1, -1, 3, -1]
    tokens = [int(torch.randint(0, VOCAB_SIZE, (1,), generator=generator)) for _ in parents]
    first_position = 7
    random = PositionRandom(seed, first_position)
    verdict = verify_tree(row.repeat(len(parents) + 1, 1), tokens, parents, [], params, random)
    one_at_a_time = [verify(row[None], [], [], params, random.starting_at(first_position + i))[0]
                     for i in range(len(verdict.token_ids))]
    assert verdict.token_ids == one_at_a_time
