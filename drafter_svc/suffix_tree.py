"""A depth-limited suffix trie with counts: the data structure behind suffix decoding.

Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975; Arctic Inference, vLLM's
`"method": "suffix"`) drafts from the continuations that followed the current context's
suffix in earlier text. The trie holds every substring of at most `max_depth` tokens of
the text inserted into it: each path from the root spells one, and a node's `count` is how
many times that substring occurs. Below a match, `child.count / node.count` is how often
the matched text went on with the child's token, so walking down the most frequent child
drafts the most likely continuation, and the product of those ratios is the draft token's
estimated probability (the reference's per-path cumulative probability).

A `Matches` list is the nodes of the current context's suffixes: matches[d - 1] is the node
spelling the last d tokens. It is kept incrementally, one child lookup per held suffix per
new token, so a step costs O(max_depth), never O(context). Suffixes of the same text are
nested (if the last d + 1 tokens occur, so do the last d), so the list is always the
lengths 1..M with M the longest match.

Memory: a sequence of n tokens adds at most n * max_depth nodes (fewer where text repeats);
removing it (`remove`) gives them back, so a trie that holds a bounded number of sequences
holds a bounded number of nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from drafter_svc.confidence import match_confidence


class Node:
    """One substring: its last token, its occurrence count, and its children by token."""

    __slots__ = ("best", "children", "count", "token")

    def __init__(self, token: int) -> None:
        self.token = token
        self.count = 0
        # None until the first child: most nodes of a deep trie are leaves.
        self.children: dict[int, Node] | None = None
        # The child with the highest count (the first to reach it on ties): kept on insert,
        # recomputed on removal, so a draft step never scans a wide node's children.
        self.best: Node | None = None

    def child(self, token: int) -> Node | None:
        return None if self.children is None else self.children.get(token)


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    # Sum of the tokens' estimated probabilities: the expected number of accepted tokens,
    # how the reference compares proposals from different match lengths and trees.
    score: float = 0.0
    match_len: int = 0
    # Per token, drafter_svc/confidence.py's estimate from the tree's counts: of the
    # occurrences of the text so far that go on (the sum of the node's children's counts),
    # how many go on with the token, at match length match_len + i.
    confidence: list[float] = field(default_factory=list)


class SuffixTree:
    """The trie of all substrings of at most `max_depth` tokens of the inserted text."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node(-1)
        self.num_nodes = 0  # without the root

    # --- insertion -----------------------------------------------------------------------
    def extend(self, matches: list[Node], token_ids: Sequence[int]) -> list[Node]:
        """Inserts tokens continuing the text whose suffixes are `matches` (which must be this
        trie's insertion list for that text, [] for a new text); returns the new list.

        Each token extends every held suffix shorter than max_depth by one and starts a new
        one at the root, so the returned list is the nodes of the text's last 1..max_depth
        tokens (all present: the text itself was just inserted).
        """
        root = self.root
        keep = self.max_depth - 1
        num_new_nodes = 0
        # The per-token work, inlined: a long prompt arrives in one update and is inserted
        # within one step's draft deadline.
        for token in token_ids:
            token = int(token)
            root.count += 1  # the root counts suffix starts, i.e. tokens
            grown: list[Node] = []
            for parent in (root, *matches[:keep]):
                children = parent.children
                if children is None:
                    children = parent.children = {}
                node = children.get(token)
                if node is None:
                    node = children[token] = Node(token)
                    num_new_nodes += 1
                node.count += 1
                best = parent.best
                if best is None or node.count > best.count:
                    parent.best = node
                grown.append(node)
            matches = grown
        self.num_nodes += num_new_nodes
        return matches

    def insert(self, token_ids: Sequence[int]) -> None:
        """Inserts a whole text (all its substrings of at most max_depth tokens)."""
        self.extend([], token_ids)

    # --- removal -------------------------------------------------------------------------
    def remove(self, token_ids: Sequence[int]) -> None:
        """Undoes `insert(token_ids)` of a text inserted earlier: decrements the counts of its
        substrings and drops the nodes no other text holds."""
        tokens = [int(token) for token in token_ids]
        for start in range(len(tokens)):
            self._decrement_path(tokens[start:start + self.max_depth])

    def _decrement_path(self, path: list[int]) -> None:
        parent = self.root
        self.root.count -= 1
        for token in path:
            node = parent.child(token)
            if node is None:  # not inserted: a caller bug; keep the trie consistent anyway
                return
            node.count -= 1
            if node.count <= 0:
                assert parent.children is not None
                del parent.children[token]
                self.num_nodes -= _subtree_size(node)
                if parent.best is node:
                    parent.best = _most_frequent(parent)
                return
            if parent.best is node:
                parent.best = _most_frequent(parent)
            parent = node

    # --- matching ------------------------------------------------------------------------
    def follow(self, matches: list[Node], token_ids: Sequence[int]) -> list[Node]:
        """The match list after the text grows by `token_ids`, without inserting anything.

        Only valid while the trie is unchanged since `matches` was computed (see `match`).
        """
        for token in token_ids:
            token = int(token)
            grown: list[Node] = []
            for parent in (self.root, *matches[:self.max_depth - 1]):
                node = parent.child(token)
                if node is None:
                    break  # nested suffixes: no longer one can match either
                grown.append(node)
            matches = grown
        return matches

    def match(self, context: Sequence[int]) -> list[Node]:
        """The match list of `context` computed from scratch (its last max_depth tokens)."""
        return self.follow([], list(context[-self.max_depth:]))

    def speculate(self, matches: list[Node], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> Draft:
        """The best draft over all match lengths, by score (ties: the shorter match).

        From the node of a match of length m, up to min(max_tokens, m * max_spec_factor)
        tokens: the most frequent child each time, while the path's probability (the product
        of child.count / node.count) stays >= min_token_prob.
        """
        best = Draft([])
        for match_len, node in enumerate(matches, start=1):
            limit = min(max_tokens, int(match_len * max_spec_factor + 1e-6))
            if limit <= 0 or node.best is None:
                continue
            draft = _walk(node, limit, min_token_prob)
            if draft.score > best.score:
                draft.match_len = match_len
                best = draft
        if best.token_ids:
            best.confidence = _confidence(matches[best.match_len - 1], best.token_ids,
                                          best.match_len)
        return best


def _walk(node: Node, limit: int, min_token_prob: float) -> Draft:
    tokens: list[int] = []
    prob = 1.0
    score = 0.0
    while len(tokens) < limit:
        child = node.best
        if child is None:
            break
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        tokens.append(child.token)
        score += prob
        node = child
    return Draft(tokens, score)


def _confidence(node: Node, token_ids: list[int], match_len: int) -> list[float]:
    """The winning draft's confidence, from its match node down its path (only the winner's:
    summing a wide node's children is not free)."""
    confidence: list[float] = []
    for token in token_ids:
        child = node.child(token)
        assert child is not None and node.children is not None
        num_going_on = sum(other.count for other in node.children.values())
        confidence.append(match_confidence(child.count, num_going_on,
                                           match_len + len(confidence)))
        node = child
    return confidence


def _most_frequent(node: Node) -> Node | None:
    if not node.children:
        return None
    return max(node.children.values(), key=lambda child: child.count)


def _subtree_size(node: Node) -> int:
    size = 0
    stack = [node]
    while stack:
        current = stack.pop()
        size += 1
        if current.children:
            stack.extend(current.children.values())
    return size
