"""Lossless verification of a tree draft (`draft_tree`'s terms): the longest path from the
root that the target keeps, then one recovered or bonus token.

The target scores every node in one forward: row 0 scores the token after the root, row
1 + i the token after node i (its path's context). The walk starts at the root; at each
step it takes the target's token for the current row and moves to the child holding that
token, if any, else stops with that token as the recovered one (or the bonus one, at a
node without children).

- Greedy: the target's token is the row's argmax, so the walk follows the target's own
  argmax chain as far as the tree holds it: the same tokens as decoding without drafts.
- Sampled: the target's token is drawn from the row's processed distribution p. This is
  SpecInfer's multi-draft rejection sampling (Miao et al. 2024) for drafts that are one-hot
  and whose siblings hold distinct tokens (a suffix trie's children do): the recursive
  rule accepts sibling x_1 with probability p(x_1), else x_2 with probability
  p(x_2) / (1 - p(x_1)) (the residual renormalised), and so on, and after rejecting all of
  them samples the residual, p without the siblings, renormalised. So child x_i is taken
  with probability p(x_i) and, when none is, the token emitted is distributed as p without
  them, normalised: exactly one draw t from p, kept as child x_i when t = x_i. The emitted
  token at every position has the target's distribution, and one uniform per emitted token
  is drawn, from the position's own generator (`PositionRandom`, as `rejection_sampler`'s
  coupled form draws): a seeded request emits the same tokens with a tree, a flat draft or
  none. Probabilistic drafts (draft_probs) do not come as trees.

Each row is processed (penalties, min_tokens, logit_bias, temperature, top-k/p) with its
path as the context after history_ids, as `rejection_sampler.verify` processes a flat row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from specdec.engine.draft_tree import children
from specdec.engine.logits_processor import argmax_rows, process_logits
from specdec.engine.rejection_sampler import RandomSource, sample_token
from specdec.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class TreeVerdict:
    """The tokens a tree draft yields (the accepted path's, then one recovered or bonus
    token) and the accepted nodes, root side first."""

    token_ids: list[int]
    path: list[int]


def verify_tree(
    target_logits: Tensor,
    node_token_ids: list[int],
    parents: list[int],
    history_ids: list[int],
    params: SamplingParams,
    generator: RandomSource,
    *,
    target_argmax_ids: list[int] | None = None,
    prompt_len: int | None = None,
    eos_token_ids: frozenset[int] | tuple[int, ...] = (),
) -> TreeVerdict:
    """Verifies one sequence's tree draft (see the module's docstring).

    target_logits: [n + 1, vocab], raw: row 0 after the root, row 1 + i after node i.
    target_argmax_ids: the raw rows' argmax, for a greedy request whose processing cannot
        move it (`rejection_sampler.needs_only_argmax`); then no row is processed.
    generator: as `rejection_sampler.verify` takes it (a seeded request's `PositionRandom`
        from the output position of row 0).
    """
    num_nodes = len(node_token_ids)
    assert target_logits.dim() == 2 and target_logits.shape[0] == num_nodes + 1, (
        f"target_logits {tuple(target_logits.shape)} for {num_nodes} tree nodes"
    )

    def target_token(row: int, emitted_ids: list[int]) -> int:
        return _target_token(target_logits, row, history_ids + emitted_ids, params, generator,
                             len(emitted_ids), target_argmax_ids, prompt_len, eos_token_ids)

    return walk_tree(node_token_ids, parents, target_token)


def walk_tree(node_token_ids: list[int], parents: list[int],
              target_token: Callable[[int, list[int]], int]) -> TreeVerdict:
    """The walk from the root: `target_token(row, tokens emitted so far)` is the target's
    token for a row (0: after the root, 1 + i: after node i); it moves to the child holding
    it while there is one."""
    token_ids: list[int] = []
    path: list[int] = []
    node, row = -1, 0
    while True:
        token_id = target_token(row, token_ids)
        token_ids.append(token_id)
        child = next((c for c in children(parents, node) if node_token_ids[c] == token_id), None)
        if child is None:
            return TreeVerdict(token_ids, path)
        path.append(child)
        node, row = child, child + 1


def _target_token(target_logits: Tensor, row: int, context_ids: list[int], params: SamplingParams,
                  generator: RandomSource, position: int, target_argmax_ids: list[int] | None,
                  prompt_len: int | None, eos_token_ids: frozenset[int] | tuple[int, ...]) -> int:
    """The target's token for `row` after `context_ids`: its argmax (greedy) or one draw
    from its processed distribution, at output position `position` of the step."""
    if target_argmax_ids is not None:
        return target_argmax_ids[row]
    processed = process_logits(target_logits[row:row + 1], context_ids, [], params,
                               prompt_len=prompt_len, eos_token_ids=eos_token_ids)  # [1, vocab]
    if params.is_greedy:
        return int(argmax_rows(processed)[0])
    return sample_token(processed[0].softmax(dim=-1), generator, position)
