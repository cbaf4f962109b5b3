"""Tree drafts: a draft whose tokens branch (suffix decoding's `use_tree_spec`, SpecInfer's
token trees), as a list of tokens and their parents.

Terms: a tree draft's tokens are its *nodes*; `parents[i]` is node i's parent, an earlier
node, or -1 for the *root*: the sequence's last verified token, which every node descends
from. Parents come before their children, so any leading part of the nodes is a tree too
(a draft cut to n tokens keeps its first n nodes). A node's *depth* is its distance from the
root (a child of the root: 1); it verifies at position `root position + depth`. A
proposer sends a node's likelier children first, so the *main branch*, the root's first
child, its first child and so on, is its most likely path: what a flat draft from the same
tree would be. A flat draft is a chain: parents `[-1, 0, 1, ...]`, or None.
"""

from __future__ import annotations


def check_parents(parents: list[int], num_nodes: int) -> str | None:
    """Why `parents` is not a tree over `num_nodes` nodes; None when it is."""
    if len(parents) != num_nodes:
        return f"{len(parents)} parents for {num_nodes} draft tokens"
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            return f"draft token {node}'s parent {parent} does not come before it"
    return None


def is_chain(parents: list[int]) -> bool:
    """Whether the tree is a flat draft (each node the child of the one before)."""
    return all(parent == node - 1 for node, parent in enumerate(parents))


def main_branch(parents: list[int]) -> list[int]:
    """The main branch's nodes, root side first."""
    nodes: list[int] = []
    node = -1
    while True:
        child = next((c for c in range(node + 1, len(parents)) if parents[c] == node), None)
        if child is None:
            return nodes
        nodes.append(child)
        node = child


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (1 for a child of the root)."""
    node_depths: list[int] = []
    for parent in parents:
        node_depths.append(1 if parent < 0 else node_depths[parent] + 1)
    return node_depths


def children(parents: list[int], node: int) -> list[int]:
    """The children of `node` (-1: the root), in node order."""
    return [child for child, parent in enumerate(parents) if parent == node]


def segment_parents(num_chunk_tokens: int, parents: list[int]) -> list[int]:
    """The tree parents of a verify segment (AttentionMetadata's terms): the uncomputed
    chunk's tokens as a chain (its last is the root), then the draft's nodes."""
    root = num_chunk_tokens - 1
    chain = list(range(-1, root))
    return chain + [root if parent < 0 else num_chunk_tokens + parent for parent in parents]


def chain_confidence(parents: list[int], confidence: list[float]) -> list[float]:
    """A tree draft's confidence as a flat draft's would read: node i's estimate that it is
    accepted given its parent is (what a tree's proposer sends) turned into one whose running
    product over the first i + 1 nodes is node i's path probability. So a policy that cuts
    a flat draft to the prefix its confidence pays for cuts a tree, whose proposer sends its
    nodes most probable first, to its most probable nodes."""
    path_probs: list[float] = []
    chain: list[float] = []
    previous = 1.0
    for parent, value in zip(parents, confidence):
        path_prob = value * (1.0 if parent < 0 else path_probs[parent])
        path_probs.append(path_prob)
        chain.append(min(1.0, path_prob / previous) if previous > 0 else 0.0)
        previous = path_prob
    return chain


def path_confidence(parents: list[int], confidence: list[float], path: list[int]) -> list[float]:
    """The confidence along a verified tree's accepted `path` and then its first rejected
    child, if any: a flat draft's confidence of which the first len(path) tokens were
    accepted (what a policy calibrates its confidence on)."""
    along = [confidence[node] for node in path]
    rejected = children(parents, path[-1] if path else -1)
    if rejected:
        along.append(confidence[rejected[0]])
    return along
