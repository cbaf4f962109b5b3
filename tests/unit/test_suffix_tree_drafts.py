"""Tree drafts from the suffix trie: the most probable nodes below a match, best first."""

from __future__ import annotations

import pytest

from drafter_svc.suffix_proposer import GlobalSuffixCache, SuffixMethod, SuffixParams
from drafter_svc.proposer import ProposerInfo
from drafter_svc.suffix_tree import SuffixTree
from drafter_svc.suffix_tree_drafts import pooled_tree_draft, tree_draft
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.errors import ConfigError
from specdec.engine.draft_tree import check_parents, main_branch
from verifier_svc.builder import VerifierConfig

A, B, C, D, X, Y, Q = range(1, 8)
# After "A B": "C D" three times, "X Y" twice, each followed by a token of its own.
TEXT = [A, B, C, D, 10, A, B, C, D, 11, A, B, C, D, 12, A, B, X, Y, 13, A, B, X, Y, 14]


def _match_node(tree: SuffixTree, context: list[int]) -> tuple[int, int]:
    matches = tree.match(context)
    return matches[-1], len(matches)


def test_a_second_continuation_outranks_the_first_ones_deep_tail() -> None:
    tree = SuffixTree(max_depth=8)
    tree.insert(TEXT)
    node, match_len = _match_node(tree, [A, B])
    draft = tree_draft(tree, node, limit=4, min_token_prob=0.1, match_len=match_len)
    # C (0.6), D (0.6), then X and Y (0.4) before what follows D (0.2 each).
    assert draft.token_ids == [C, D, X, Y]
    assert draft.parents == [-1, 0, -1, 2]
    assert check_parents(draft.parents, 4) is None
    assert draft.score == pytest.approx(0.6 + 0.6 + 0.4 + 0.4)
    assert [draft.token_ids[node] for node in main_branch(draft.parents)] == [C, D]
    assert len(draft.confidence) == 4 and all(0.0 <= value <= 1.0 for value in draft.confidence)
    flat = tree.speculate(tree.match([A, B]), 4, 2.0, 0.1)
    assert draft.score > flat.score


def test_min_token_prob_and_the_budget_bound_the_tree() -> None:
    tree = SuffixTree(max_depth=8)
    tree.insert(TEXT)
    node, match_len = _match_node(tree, [A, B])
    assert tree_draft(tree, node, limit=8, min_token_prob=0.5, match_len=match_len).token_ids == [C, D]
    assert tree_draft(tree, node, limit=1, min_token_prob=0.1, match_len=match_len).token_ids == [C]


def test_one_pooled_trie_drafts_as_the_trie_itself() -> None:
    tree = SuffixTree(max_depth=8)
    tree.insert(TEXT)
    node, match_len = _match_node(tree, [A, B])
    alone = tree_draft(tree, node, limit=5, min_token_prob=0.1, match_len=match_len)
    pooled = pooled_tree_draft([(tree, node)], limit=5, min_token_prob=0.1, match_len=match_len)
    assert (pooled.token_ids, pooled.parents, pooled.score) == (alone.token_ids, alone.parents, alone.score)


@pytest.mark.parametrize("use_tree_spec", [False, True])
def test_the_suffix_method_sends_trees_only_when_configured(use_tree_spec: bool) -> None:
    config = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 4,
                                      "suffix_decoding_use_tree_spec": use_tree_spec})
    assert config.suffix_decoding_use_tree_spec is use_tree_spec
    params = SuffixParams(max_tree_depth=8, max_spec_factor=2.0, min_token_prob=0.1,
                          num_speculative_tokens=4, use_tree_spec=use_tree_spec)
    method = SuffixMethod(params, GlobalSuffixCache(8, 0), ProposerInfo(method="suffix",
                                                                          max_num_speculative_tokens=4))
    method.add_sequence(1)
    method.append_tokens(1, [*TEXT, Q, A, B], None)  # the longest match: A B
    (proposal,) = method.propose([1], [4])
    if use_tree_spec:
        assert proposal.parents is not None and check_parents(proposal.parents, 4) is None
        assert proposal.draft_token_ids == [C, D, X, Y] and proposal.parents == [-1, 0, -1, 2]
    else:
        assert proposal.parents is None and proposal.draft_token_ids[:2] == [C, D]


def test_the_tree_field_is_off_by_default_and_checked() -> None:
    config = SpeculativeConfig.parse({"method": "suffix"})
    assert config.suffix_decoding_use_tree_spec is False
    tree = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_use_tree_spec": True})
    assert SpeculativeConfig.parse(tree.to_json()) == tree
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_use_tree_spec": 1})
    assert info.value.param == "suffix_decoding_use_tree_spec"
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "suffix_decoding_use_tree_spec": True})
    assert info.value.param == "suffix_decoding_use_tree_spec"


def test_tree_drafts_are_refused_with_tensor_parallelism() -> None:
    """The accepted path's K/V is moved on rank 0's cache only."""
    spec = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_use_tree_spec": True})
    with pytest.raises(ConfigError) as info:
        build_config(VerifierConfig, model="unused", tensor_parallel_size=2, speculative_config=spec,
                     drafter_targets=("127.0.0.1:1",))
    assert info.value.param == "suffix_decoding_use_tree_spec"
