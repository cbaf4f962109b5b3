"""Tree drafts from a suffix trie (`suffix_decoding_use_tree_spec`, Arctic Inference's
`use_tree_spec`): below a match, the most probable continuations, branching where the
matched text went on in more than one way.

A flat draft walks the most frequent child at each step. A tree draft takes, up to its
token budget, the nodes below the match whose path probability (the product of child count
/ node count down the path, as a flat draft's) is highest, best first, each at least
min_token_prob: a second continuation that is likelier than the flat draft's deep tail
replaces that tail. Its score, the sum of the nodes' path probabilities, is its expected
number of accepted tokens, as a flat draft's is. Nodes come most probable first, so every
parent comes before its children and a draft cut to its first n nodes keeps the n most
probable (specdec/engine/draft_tree.py's terms); a node's confidence is its estimate given
its parent is accepted (drafter_svc/confidence.py, at its depth's match length).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TypeVar

from drafter_svc.confidence import match_confidence
from drafter_svc.suffix_tree import Draft, Pool, SuffixTree, pooled_child, pooled_count

State = TypeVar("State")
# A node's children as (token, child, the child's count), and the node's own count.
Children = Callable[[State], list[tuple[int, State, int]]]


def tree_draft(tree: SuffixTree, node: int, limit: int, min_token_prob: float, match_len: int) -> Draft:
    """The tree draft of at most `limit` tokens below `node`, a match of `match_len`."""

    def children_of(parent: int) -> list[tuple[int, int, int]]:
        return [(token, child, tree.count(child)) for token, child in tree.children(parent).items()]

    return _expand(node, tree.count, children_of, limit, min_token_prob, match_len)


def pooled_tree_draft(pool: Pool, limit: int, min_token_prob: float, match_len: int) -> Draft:
    """As `tree_draft`, over several tries' nodes spelling one text, their counts pooled
    (suffix_tree.speculate_pooled's terms)."""

    def count_of(nodes: Pool) -> int:
        return sum(tree.count(node) for tree, node in nodes)

    def children_of(nodes: Pool) -> list[tuple[int, Pool, int]]:
        tokens = dict.fromkeys(token for tree, node in nodes for token in tree.children(node))
        return [(token, pooled_child(nodes, token), pooled_count(nodes, token)) for token in tokens]

    return _expand(pool, count_of, children_of, limit, min_token_prob, match_len)


def _expand(root: State, count_of: Callable[[State], int], children_of: Children[State], limit: int,
            min_token_prob: float, match_len: int) -> Draft:
    """Best-first expansion below `root` (ties: the earlier found)."""
    draft = Draft([], match_len=match_len)
    parents: list[int] = []
    # (-path probability, order found, parent index, token, child, confidence)
    frontier: list[tuple[float, int, int, int, State, float]] = []
    num_found = 0

    def push_children(state: State, index: int, prob: float, depth: int) -> None:
        nonlocal num_found
        children = children_of(state)
        total = count_of(state)
        num_going_on = sum(count for _, _, count in children)
        if total <= 0:
            return
        for token, child, count in children:
            child_prob = prob * count / total
            if child_prob >= min_token_prob:
                confidence = match_confidence(count, num_going_on, match_len + depth)
                heapq.heappush(frontier, (-child_prob, num_found, index, token, child, confidence))
                num_found += 1

    push_children(root, -1, 1.0, 0)
    depths: list[int] = []
    while frontier and len(draft.token_ids) < limit:
        negative_prob, _, parent, token, child, confidence = heapq.heappop(frontier)
        depth = 1 if parent < 0 else depths[parent] + 1
        draft.token_ids.append(token)
        draft.confidence.append(confidence)
        draft.score += -negative_prob
        parents.append(parent)
        depths.append(depth)
        push_children(child, len(parents) - 1, -negative_prob, depth)
    draft.parents = parents
    return draft
