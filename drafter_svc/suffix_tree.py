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

A node is an int, an index into parallel lists (its token, count, most frequent child,
children by token), not a Python object: the cyclic garbage collector scans every object
that can hold references, and a drafter's tries hold millions of nodes. As objects (a
slotted class with a dict of children) they made the drafter's full collections take
90-210 ms each (1.5 s in one 96-request agent run at 16 requests), each a stall longer than
the verifier's draft deadline. A children dict that maps ints to ints is one the collector
does not track, so a trie adds a handful of scanned objects however large it grows.

Most nodes of a deep trie have at most one child (past a few tokens, text rarely repeats),
so only a node with two or more children has a children dict; an only child is the node's
most frequent one (`best`), found by its token. A one-entry dict costs ~200 bytes: with it
every node had one, and a trie over the built-in workloads' texts took 274 bytes a node
(30 MiB for an 8,000-token context) and 13.0 ms per 1,000 tokens to build.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from drafter_svc.confidence import match_confidence

ROOT = 0       # the root's node id: the empty substring
NO_NODE = -1   # "no node", in the best-child list
# Scores closer than this are equal: sums of the same probabilities in another order differ
# in their last bits, and a tie rule must not turn on rounding.
SCORE_TOLERANCE = 1e-9


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
    # A tree draft's parents (drafter_svc/suffix_tree_drafts.py); None for a flat one.
    parents: list[int] | None = None


class SuffixTree:
    """The trie of all substrings of at most `max_depth` tokens of the inserted text.

    Nodes are ids (ROOT is the root); `count`, `token`, `best`, `child` and `children` read
    them. A match list (of node ids) is valid until the next `remove`: a removed node's id
    is given to a later new node.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.num_nodes = 0  # without the root
        # Per node id: its last token, how often its substring occurs, its most frequent
        # child (the first to reach that count on ties; NO_NODE for a leaf, kept on insert
        # and recomputed on removal, so a draft step never scans a wide node's children; a
        # node's only child when it has one), and its children by token (None unless it has
        # two or more: most nodes of a deep trie have none or one).
        self._token: list[int] = [-1]
        self._count: list[int] = [0]
        self._best: list[int] = [NO_NODE]
        self._children: list[dict[int, int] | None] = [None]
        self._free: list[int] = []  # ids of removed nodes, reused first

    # --- reading -------------------------------------------------------------------------
    def count(self, node: int) -> int:
        return self._count[node]

    def token(self, node: int) -> int:
        return self._token[node]

    def best(self, node: int) -> int | None:
        """The most frequent child; None for a leaf."""
        best = self._best[node]
        return None if best == NO_NODE else best

    def child(self, node: int, token: int) -> int | None:
        children = self._children[node]
        if children is not None:
            return children.get(token)
        only = self._best[node]
        return only if only != NO_NODE and self._token[only] == token else None

    def children(self, node: int) -> dict[int, int]:
        """Token -> child id (a copy)."""
        children = self._children[node]
        if children is not None:
            return dict(children)
        only = self._best[node]
        return {} if only == NO_NODE else {self._token[only]: only}

    # --- insertion -----------------------------------------------------------------------
    def extend(self, matches: list[int], token_ids: Sequence[int]) -> list[int]:
        """Inserts tokens continuing the text whose suffixes are `matches` (which must be this
        trie's insertion list for that text, [] for a new text); returns the new list.

        Each token extends every held suffix shorter than max_depth by one and starts a new
        one at the root, so the returned list is the nodes of the text's last 1..max_depth
        tokens (all present: the text itself was just inserted).
        """
        keep = self.max_depth - 1
        token_of, count, best, children_of, free = (self._token, self._count, self._best,
                                                     self._children, self._free)
        num_new_nodes = 0
        # The per-token work, inlined: a long prompt arrives in one update and is inserted
        # within one step's draft deadline.
        for token in token_ids:
            token = int(token)
            count[ROOT] += 1  # the root counts suffix starts, i.e. tokens
            grown: list[int] = []
            for parent in (ROOT, *matches[:keep]):
                children = children_of[parent]
                parent_best = best[parent]
                if children is not None:
                    node = children.get(token)
                elif parent_best != NO_NODE and token_of[parent_best] == token:
                    node = parent_best  # the only child
                else:
                    node = None
                if node is None:
                    if free:
                        node = free.pop()
                        token_of[node] = token
                    else:
                        node = len(count)
                        token_of.append(token)
                        count.append(0)
                        best.append(NO_NODE)
                        children_of.append(None)
                    if children is not None:
                        children[token] = node
                    elif parent_best != NO_NODE:  # a second child: now a dict
                        children_of[parent] = {token_of[parent_best]: parent_best, token: node}
                    num_new_nodes += 1
                node_count = count[node] = count[node] + 1
                if parent_best == NO_NODE or node_count > count[parent_best]:
                    best[parent] = node
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
        count, best, children_of = self._count, self._best, self._children
        parent = ROOT
        count[ROOT] -= 1
        for token in path:
            node = self.child(parent, token)
            if node is None:  # not inserted: a caller bug; keep the trie consistent anyway
                return
            count[node] -= 1
            if count[node] <= 0:
                children = children_of[parent]
                if children is None:  # the only child
                    best[parent] = NO_NODE
                else:
                    del children[token]
                    if len(children) == 1:  # one child left: no dict
                        children_of[parent] = None
                        best[parent] = next(iter(children.values()))
                    elif best[parent] == node:
                        best[parent] = self._most_frequent(parent)
                self._free_subtree(node)
                return
            if best[parent] == node:
                best[parent] = self._most_frequent(parent)
            parent = node

    def _free_subtree(self, node: int) -> None:
        count, best, children_of, free = self._count, self._best, self._children, self._free
        stack = [node]
        while stack:
            current = stack.pop()
            children = children_of[current]
            if children:
                stack.extend(children.values())
            elif best[current] != NO_NODE:
                stack.append(best[current])
            children_of[current] = None
            count[current] = 0
            best[current] = NO_NODE
            free.append(current)
            self.num_nodes -= 1

    def _most_frequent(self, node: int) -> int:
        children = self._children[node]
        if children is None:
            return self._best[node]  # none, or the only child
        count = self._count
        return max(children.values(), key=count.__getitem__)

    # --- matching ------------------------------------------------------------------------
    def follow(self, matches: list[int], token_ids: Sequence[int]) -> list[int]:
        """The match list after the text grows by `token_ids`, without inserting anything.

        Only valid while the trie is unchanged since `matches` was computed (see `match`).
        """
        children_of, best, token_of = self._children, self._best, self._token
        keep = self.max_depth - 1
        for token in token_ids:
            token = int(token)
            grown: list[int] = []
            for parent in (ROOT, *matches[:keep]):
                children = children_of[parent]
                if children is not None:
                    node = children.get(token)
                else:
                    only = best[parent]
                    node = only if only != NO_NODE and token_of[only] == token else None
                if node is None:
                    break  # nested suffixes: no longer one can match either
                grown.append(node)
            matches = grown
        return matches

    def match(self, context: Sequence[int]) -> list[int]:
        """The match list of `context` computed from scratch (its last max_depth tokens)."""
        return self.follow([], list(context[-self.max_depth:]))

    def speculate(self, matches: list[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float, min_match_len: int = 1) -> Draft:
        """The best draft over the match lengths from `min_match_len` on, by score (ties:
        the longer match, the more specific context).

        From the node of a match of length m, up to min(max_tokens, m * max_spec_factor)
        tokens: the most frequent child each time, while the path's probability (the product
        of child count / node count) stays >= min_token_prob.
        """
        best_draft = Draft([])
        for match_len, node in enumerate(matches[min_match_len - 1:], start=min_match_len):
            limit = min(max_tokens, int(match_len * max_spec_factor + 1e-6))
            if limit <= 0 or self._best[node] == NO_NODE:
                continue
            draft = self._walk(node, limit, min_token_prob)
            if draft.token_ids and draft.score >= best_draft.score - SCORE_TOLERANCE:
                draft.match_len = match_len
                best_draft = draft
        if best_draft.token_ids:
            best_draft.confidence = self._confidence(matches[best_draft.match_len - 1],
                                                     best_draft.token_ids, best_draft.match_len)
        return best_draft

    def _walk(self, node: int, limit: int, min_token_prob: float) -> Draft:
        count, best, token_of = self._count, self._best, self._token
        tokens: list[int] = []
        prob = 1.0
        score = 0.0
        while len(tokens) < limit:
            child = best[node]
            if child == NO_NODE:
                break
            prob *= count[child] / count[node]
            if prob < min_token_prob:
                break
            tokens.append(token_of[child])
            score += prob
            node = child
        return Draft(tokens, score)

    def _confidence(self, node: int, token_ids: list[int], match_len: int) -> list[float]:
        """The winning draft's confidence, from its match node down its path (only the
        winner's: summing a wide node's children is not free)."""
        count, children_of = self._count, self._children
        confidence: list[float] = []
        for token in token_ids:
            children = children_of[node]
            if children is None:  # the only child
                child = self._best[node]
                num_going_on = count[child]
            else:
                child = children[token]
                num_going_on = sum(count[other] for other in children.values())
            confidence.append(match_confidence(count[child], num_going_on,
                                               match_len + len(confidence)))
            node = child
        return confidence



Pool = list[tuple[SuffixTree, int]]  # one node per trie, all spelling the same text


def speculate_pooled(sources: Sequence[tuple[SuffixTree, list[int]]], max_tokens: int,
                     max_spec_factor: float, min_token_prob: float,
                     min_match_len: int = 1) -> Draft:
    """`SuffixTree.speculate` over several tries' text as if it were one trie: a substring's
    count is the sum of its counts in each (a trie whose match list is shorter holds no
    longer match). Each token is the best child in one of the tries, the one with the largest
    pooled count (ties: the earlier source's), and its probability is pooled counts over
    pooled counts, so an occurrence that does not go on in one trie (the context's own last
    one, in the trie of the sequence's output) weighs against a continuation another trie is
    sure of. Ties between match lengths go to the longer match; match lengths from
    `min_match_len` on."""
    best_draft, best_pool = Draft([]), None
    longest = max((len(matches) for _, matches in sources), default=0)
    for match_len in range(min_match_len, longest + 1):
        limit = min(max_tokens, int(match_len * max_spec_factor + 1e-6))
        if limit <= 0:
            continue
        pool = [(tree, matches[match_len - 1]) for tree, matches in sources
                if len(matches) >= match_len]
        draft = _walk_pooled(pool, limit, min_token_prob)
        if draft.token_ids and draft.score >= best_draft.score - SCORE_TOLERANCE:
            draft.match_len, best_draft, best_pool = match_len, draft, pool
    if best_pool is not None:
        best_draft.confidence = _pooled_confidence(best_pool, best_draft.token_ids,
                                                   best_draft.match_len)
    return best_draft


def pooled_count(pool: Pool, token: int) -> int:
    """The pooled count of the pool's child for `token`."""
    total = 0
    for tree, node in pool:
        child = tree.child(node, token)
        if child is not None:
            total += tree.count(child)
    return total


def pooled_child(pool: Pool, token: int) -> Pool:
    return [(tree, child) for tree, child in ((tree, tree.child(node, token)) for tree, node in pool)
            if child is not None]


def _walk_pooled(pool: Pool, limit: int, min_token_prob: float) -> Draft:
    tokens: list[int] = []
    prob = 1.0
    score = 0.0
    while len(tokens) < limit and pool:
        best_token, best_count = -1, 0
        for tree, node in pool:
            child = tree.best(node)
            if child is not None:
                count = pooled_count(pool, tree.token(child))
                if count > best_count:
                    best_token, best_count = tree.token(child), count
        if best_count == 0:
            break
        prob *= best_count / sum(tree.count(node) for tree, node in pool)
        if prob < min_token_prob:
            break
        tokens.append(best_token)
        score += prob
        pool = pooled_child(pool, best_token)
    return Draft(tokens, score)


def _pooled_confidence(pool: Pool, token_ids: list[int], match_len: int) -> list[float]:
    """As `SuffixTree._confidence`, over the pooled counts (the winner's only)."""
    confidence: list[float] = []
    for token in token_ids:
        num_going_on = sum(tree.count(child) for tree, node in pool
                           for child in tree.children(node).values())
        confidence.append(match_confidence(pooled_count(pool, token), num_going_on,
                                           match_len + len(confidence)))
        pool = pooled_child(pool, token)
    return confidence
