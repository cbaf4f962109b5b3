"""The suffix trie behind suffix decoding: counts, depth limit, matching, drafting, removal."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from drafter_svc.suffix_tree import ROOT, SuffixTree, speculate_pooled


def node_at(tree: SuffixTree, path: list[int]) -> int | None:
    node: int | None = ROOT
    for token in path:
        node = tree.child(node, token) if node is not None else None
    return node


def counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every substring held, with its count."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[tuple[int, ...], int]] = [((), ROOT)]
    while stack:
        path, node = stack.pop()
        for token, child in tree.children(node).items():
            out[path + (token,)] = tree.count(child)
            stack.append((path + (token,), child))
    return out


def assert_best_children(tree: SuffixTree) -> None:
    """Each node's best child is its most frequent one."""
    stack = [ROOT]
    while stack:
        node = stack.pop()
        children = tree.children(node)
        best = tree.best(node)
        if children:
            assert best is not None
            assert tree.count(best) == max(tree.count(child) for child in children.values())
            stack.extend(children.values())
        else:
            assert best is None


def assert_compact(tree: SuffixTree) -> None:
    """Only nodes with two or more children hold a children dict."""
    assert all(children is None or len(children) >= 2 for children in tree._children)


def brute_counts(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for text in texts:
        for start in range(len(text)):
            for end in range(start + 1, min(start + depth, len(text)) + 1):
                key = tuple(text[start:end])
                out[key] = out.get(key, 0) + 1
    return out


@pytest.mark.parametrize("texts, depth", [
    ([[1, 2, 3, 1, 2, 4]], 3),
    ([[1, 2, 3, 1, 2, 4]], 1),
    ([list(range(10))], 3),
    ([[7] * 12], 4),
    ([[1, 2, 3], [2, 3, 4], [1, 2, 3]], 24),
])
def test_insertion_counts_every_substring_up_to_the_depth(texts, depth) -> None:
    tree = SuffixTree(depth)
    for text in texts:
        tree.insert(text)
    expected = brute_counts(texts, depth)
    assert counts(tree) == expected
    assert tree.num_nodes == len(expected)
    assert max(len(path) for path in counts(tree)) <= depth


def test_extend_in_pieces_equals_one_insert() -> None:
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]
    whole, pieces = SuffixTree(5), SuffixTree(5)
    whole.insert(text)
    matches: list[int] = []
    for start in range(0, len(text), 4):
        matches = pieces.extend(matches, text[start:start + 4])
    assert counts(pieces) == counts(whole)
    # The insertion list is the nodes of the text's last 1..depth tokens.
    assert matches == [node_at(pieces, text[-d:]) for d in range(1, 6)]


@pytest.mark.parametrize("context, expected_len", [
    ([9, 9, 9], 0),            # last token never seen
    ([9, 9, 4], 1),            # "4" seen, "9 4" not
    ([9, 1, 2], 2),            # "1 2"
    ([5, 1, 2, 3], 3),         # "1 2 3" but not "5 1 2 3"
    ([0, 1, 2, 3, 1, 2], 5),   # "1 2 3 1 2", not "0 1 2 3 1 2"
    ([1, 2, 3, 1, 2, 4, 7], 0),
])
def test_match_finds_the_longest_suffix_held(context, expected_len) -> None:
    tree = SuffixTree(6)
    tree.insert([1, 2, 3, 1, 2, 4])
    matches = tree.match(context)
    assert len(matches) == expected_len
    for length, node in enumerate(matches, start=1):
        assert node == node_at(tree, context[-length:])


def test_follow_is_incremental_match() -> None:
    rng = random.Random(0)
    tree = SuffixTree(5)
    for _ in range(20):
        tree.insert([rng.randrange(6) for _ in range(30)])
    context = [rng.randrange(6) for _ in range(40)]
    matches: list[int] = []
    for end in range(1, len(context) + 1):
        matches = tree.follow(matches, context[end - 1:end])
        assert matches == tree.match(context[:end])


def test_match_is_limited_to_the_depth() -> None:
    tree = SuffixTree(3)
    tree.insert(list(range(10)))
    assert len(tree.match(list(range(10)))) == 3


# texts, context, max_tokens, spec factor, min prob -> draft (tree depth 24 but where given)
@pytest.mark.parametrize("texts, context, max_tokens, factor, min_prob, expected", [
    # "1 2" went on with 3 twice and with 4 once: the most frequent wins (p = 2/3).
    ([[1, 2, 3, 1, 2, 3, 1, 2, 4]], [1, 2], 1, 1.0, 0.1, [3]),
    # The probability cut: 2/3 < 0.7 drafts nothing.
    ([[1, 2, 3, 1, 2, 3, 1, 2, 4]], [1, 2], 1, 1.0, 0.7, []),
    # Adaptive length: a match of m tokens drafts at most m * factor.
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [2], 8, 1.0, 0.1, [3]),
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2], 8, 1.0, 0.1, [3, 4]),
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2], 8, 2.0, 0.1, [3, 4, 5, 6]),
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4], 8, 0.5, 0.1, [5, 6]),
    # num_speculative_tokens caps it.
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4], 1, 1.0, 0.1, [5]),
    # The depth limits match + draft (depth 4 below): "1 2 3" drafts [4], "3" drafts [4, 5, 6],
    # whose score is higher.
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3], 8, 8.0, 0.1, [4, 5, 6]),
    # Cumulative probability: 1 -> (2 | 3) half each, 2 -> 9 then 10: p = 1/2 for each
    # token below the branch, so min prob 0.6 drafts nothing after "1".
    ([[1, 2, 9, 10], [1, 3, 9, 10]], [1], 3, 3.0, 0.6, []),
    ([[1, 2, 9, 10], [1, 2, 9, 10], [1, 3, 9, 10]], [1], 3, 3.0, 0.6, [2, 9, 10]),
    # Nothing seen: no draft.
    ([[1, 2, 3]], [7], 4, 1.0, 0.1, []),
])
def test_speculate(texts, context, max_tokens, factor, min_prob, expected) -> None:
    tree = SuffixTree(4 if factor == 8.0 else 24)
    for text in texts:
        tree.insert(text)
    draft = tree.speculate(tree.match(context), max_tokens, factor, min_prob)
    assert draft.token_ids == expected


def test_the_best_score_wins_across_match_lengths() -> None:
    tree = SuffixTree(8)
    # After "5", 6 always follows (4 times); after "4 5" the text went on with 6 once and
    # with 1 once: the one-token match has the higher expected acceptance.
    tree.insert([4, 5, 7, 5, 6, 0, 5, 6, 0, 5, 6, 0, 5, 6, 0])
    # "4 5" -> 7, 5 (p = 1 each, score 2) beats "5" -> 6 (p 4/5) and "5 6" -> 0.
    draft = tree.speculate(tree.match([4, 5]), 2, 1.0, 0.1)
    assert draft.token_ids == [7, 5]
    assert draft.match_len == 2
    draft = tree.speculate(tree.match([3, 5]), 2, 1.0, 0.1)
    assert draft.token_ids == [6] and draft.match_len == 1


def test_remove_restores_the_tree_without_the_text() -> None:
    rng = random.Random(1)
    texts = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    tree = SuffixTree(6)
    for text in texts:
        tree.insert(text)
    for index in (3, 0, 7):
        tree.remove(texts[index])
    kept = [text for i, text in enumerate(texts) if i not in (0, 3, 7)]
    expected = brute_counts(kept, 6)
    assert counts(tree) == expected
    assert tree.num_nodes == len(expected)
    assert_best_children(tree)
    assert_compact(tree)
    for text in kept:
        tree.remove(text)
    assert tree.num_nodes == 0 and not tree.children(ROOT)


def test_removed_nodes_are_reused_and_the_trie_stays_right() -> None:
    # A node id freed by a removal goes to a later new node: the counts are those of a trie
    # built from the kept texts alone, and every best child is right.
    rng = random.Random(2)
    tree = SuffixTree(5)
    held: list[list[int]] = []
    for _ in range(200):
        text = [rng.randrange(7) for _ in range(rng.randrange(1, 30))]
        tree.insert(text)
        held.append(text)
        if len(held) > 8:
            tree.remove(held.pop(0))
    fresh = SuffixTree(5)
    for text in held:
        fresh.insert(text)
    assert counts(tree) == counts(fresh) == brute_counts(held, 5)
    assert tree.num_nodes == fresh.num_nodes
    assert_best_children(tree)
    assert_compact(tree)


def test_the_trie_gives_the_garbage_collector_nothing_per_node_to_scan() -> None:
    # A drafter's tries hold millions of nodes; as objects the collector tracks, every full
    # collection walked them all (90-210 ms stalls in the drafter at 16 requests).
    gc.collect()
    tree = SuffixTree(24)
    before = len(gc.get_objects())
    rng = random.Random(3)
    tree.insert([rng.randrange(500) for _ in range(5_000)])
    assert tree.num_nodes > 50_000
    assert len(gc.get_objects()) - before < 20


def test_a_node_with_one_child_costs_no_dict() -> None:
    # Past a few tokens text rarely repeats, so most nodes have at most one child; a dict
    # per node made a trie ~270 bytes a node (30 MiB for an 8,000-token context).
    rng = random.Random(4)
    text = [rng.randrange(300, 800) for _ in range(4_000)]
    tracemalloc.start()
    try:
        tree = SuffixTree(24)
        tree.insert(text)
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tree.num_nodes > 80_000
    assert_compact(tree)
    assert size / tree.num_nodes < 100


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SuffixTree(0)


def test_pooled_tries_draft_as_one_trie_over_their_text() -> None:
    earlier, own = SuffixTree(8), SuffixTree(8)
    earlier.insert([1, 2, 3, 1, 2, 3])      # "1 2" went on with 3, twice
    own_matches = own.extend([], [1, 2])    # this text's own "1 2", not gone on yet
    pooled = speculate_pooled([(earlier, earlier.match([1, 2])), (own, own_matches)], 4, 1.0, 0.1)
    # "1 2": 2 + 1 occurrences, 2 going on with 3: p = 2/3; then "1 2 3" (2, only in the
    # first trie) goes on with 1 once: p = 2/3 x 1/2. At most 2 tokens (a 2-token match).
    assert pooled.token_ids == [3, 1] and pooled.match_len == 2
    assert pooled.score == pytest.approx(2 / 3 + 1 / 3)
    alone = earlier.speculate(earlier.match([1, 2]), 4, 1.0, 0.1)
    assert alone.token_ids == [3, 1] and alone.score == pytest.approx(1.0 + 0.5)
    # The same text in one trie drafts the same.
    both = SuffixTree(8)
    both.insert([1, 2, 3, 1, 2, 3])
    matches = both.extend([], [1, 2])
    assert both.speculate(matches, 4, 1.0, 0.1).score == pytest.approx(pooled.score)
    assert len(pooled.confidence) == 2


def test_a_minimum_match_length_leaves_shorter_matches_out() -> None:
    tree = SuffixTree(8)
    matches = tree.extend([], [5, 6, 7, 9, 6, 7, 8, 6, 7])
    # "6 7" (2 tokens) went on with 9 and 8; "7" alone too; with the match at least 3 long,
    # only "x 6 7" counts, and no 3-token suffix of the text occurred before.
    assert tree.speculate(matches, 2, 1.0, 0.1).token_ids
    assert tree.speculate(matches, 2, 1.0, 0.1, min_match_len=3).token_ids == []
