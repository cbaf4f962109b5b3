"""Lossless verification of draft tokens: speculative sampling.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", and
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling".

Terms, per verify step of one sequence with k draft tokens x_0 .. x_{k-1}:

- a draft token is *accepted* when the target keeps it;
- at the first rejection the target emits a *recovered* token in its place, and the rest of
  the draft is discarded;
- when all k are accepted the target emits one extra *bonus* token from position k.

So one step yields (accepted + 1) tokens, between 1 and k + 1, and the tokens emitted have
exactly the distribution of decoding from the target alone (greedy: the same tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.engine.logits_processor import argmax_rows, process_logits
from specdec.engine.position_random import ACCEPT, SAMPLE, PositionRandom
from specdec.engine.sampling_params import SamplingParams

# Where a step's draws come from: a seeded request's per-position generators, a generator
# drawn in turn (a caller's own), or None for torch's default one.
RandomSource = PositionRandom | torch.Generator | None


def verify(
    target_logits: Tensor,
    draft_token_ids: list[int],
    history_ids: list[int],
    params: SamplingParams,
    generator: RandomSource,
    draft_probs: Tensor | None = None,
    *,
    prompt_len: int | None = None,
    eos_token_ids: frozenset[int] | tuple[int, ...] = (),
) -> list[int]:
    """Verify one sequence's draft; return the accepted drafts followed by one more token.

    target_logits: [k + 1, vocab], raw from the target model; row i scores the token after
        the last verified token (i = 0) or after draft i - 1.
    draft_token_ids: the k >= 0 draft tokens; k = 0 is plain decoding (sample one token).
    history_ids: prompt + output so far (the repetition penalty's context before row 0).
    params: the request's sampling parameters; `target_probs` is what `process_logits` and a
        softmax make of target_logits.
    generator: a seeded request's `PositionRandom` (from the output position of row 0): row
        i's draws come from (seed, that position + i) alone, so the same seed and logits give
        the same tokens whatever drafts arrived or what else the step held; or a generator
        (on any device) drawn from in turn; or None for torch's default one.
    draft_probs: [k, vocab], the drafter's distribution per position (probabilistic drafting);
        None means greedy drafts, i.e. one-hot draft_probs on each draft token.
    prompt_len, eos_token_ids: as `process_logits` takes them (presence/frequency penalties
        and min_tokens count the output tokens, and the drafts before each position).

    Rules:
    - greedy request: accept x_i iff x_i == argmax target_probs_i; recovered/bonus = argmax.
      draft_probs play no part.
    - sampled request with probabilistic drafts: accept x_i with probability
      min(1, target_probs_i(x_i) / draft_probs_i(x_i)); at the first rejection sample the
      recovered token from normalise(max(target_probs_i - draft_probs_i, 0)) (target_probs_i
      if that is all zero); the bonus token is sampled from target_probs_k.
    - sampled request with one-hot drafts: the same rule reduces to "accept x_i with
      probability target_probs_i(x_i), else sample from target_probs_i without x_i". It is
      computed in the coupled form: draw t_i from target_probs_i and accept x_i iff
      t_i == x_i, else emit t_i. Same distribution, and one uniform per emitted token, so a
      seeded request emits the same tokens whatever drafts arrived (or none).

    Worked example (sampled, one-hot draft, vocab {a, b, c}, k = 1, draft x_0 = b):
        target_probs_0 = (0.6, 0.3, 0.1). Draw t_0 from it, say a: b is rejected and a is
        the recovered token: the step returns [a]. Had t_0 been b, b would be accepted and a
        bonus token drawn from target_probs_1: [b, bonus]. P(b first) = 0.3, and given a
        rejection t_0 is distributed as (0.6, 0, 0.1) / 0.7, the rule's residual.
    Greedy example: argmax rows (5, 7, 2) with drafts [5, 9] returns [5, 7] (5 accepted, 9
        rejected, 7 recovered); drafts [5, 7] return [5, 7, 2] (2 is the bonus token).
    """
    num_drafts = len(draft_token_ids)
    assert target_logits.dim() == 2 and target_logits.shape[0] == num_drafts + 1, (
        f"target_logits {tuple(target_logits.shape)} for {num_drafts} drafts"
    )
    processed_logits = process_logits(
        target_logits, history_ids, draft_token_ids, params, prompt_len=prompt_len, eos_token_ids=eos_token_ids
    )  # [k + 1, vocab]
    if params.is_greedy:
        return _verify_greedy(processed_logits, draft_token_ids)
    # All k + 1 rows at once: one vectorised softmax costs less than a Python loop that stops
    # at the first rejection, for the small k of speculative decoding.
    target_probs = processed_logits.softmax(dim=-1)  # [k + 1, vocab]
    return _verify_sampled(target_probs, draft_token_ids, generator, draft_probs)


def needs_only_argmax(params: SamplingParams) -> bool:
    """Whether `verify` comes down to `accept_greedy` on the raw logits' argmax: a greedy
    request with no processing that can move the argmax (penalties, logit_bias, min_tokens)."""
    return params.is_greedy and not params.moves_argmax


def argmax_ids(logits: Tensor) -> list[int]:
    """Each row's argmax, as `verify` takes it for greedy requests (on the fp32 logits), in
    one call and one sync for a whole step's rows."""
    return argmax_rows(logits.float()).tolist()


def _verify_greedy(processed_logits: Tensor, draft_token_ids: list[int]) -> list[int]:
    return accept_greedy(argmax_rows(processed_logits).tolist(), draft_token_ids)  # one sync


def accept_greedy(target_argmax_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """A greedy verify step from its k + 1 target argmax ids: the drafts up to the first that
    differs, then the target's token there (recovered) or after the last draft (bonus)."""
    output_ids: list[int] = []
    for draft_id, target_id in zip(draft_token_ids, target_argmax_ids):
        if draft_id != target_id:
            output_ids.append(target_id)  # recovered
            return output_ids
        output_ids.append(draft_id)  # accepted
    output_ids.append(target_argmax_ids[-1])  # bonus
    return output_ids


def _verify_coupled(target_probs: Tensor, draft_token_ids: list[int],
                    generator: RandomSource) -> list[int]:
    """The coupled form (see verify): one draw per position, kept while it equals the draft."""
    num_drafts = len(draft_token_ids)
    output_ids: list[int] = []
    for position in range(num_drafts):
        token_id = sample_token(target_probs[position], generator, position)
        output_ids.append(token_id)
        if token_id != draft_token_ids[position]:
            return output_ids
    output_ids.append(sample_token(target_probs[num_drafts], generator, num_drafts))  # bonus
    return output_ids


def _verify_sampled(
    target_probs: Tensor,
    draft_token_ids: list[int],
    generator: RandomSource,
    draft_probs: Tensor | None,
) -> list[int]:
    if draft_probs is None:
        return _verify_coupled(target_probs, draft_token_ids, generator)
    num_drafts = len(draft_token_ids)
    device = target_probs.device
    num_accepted = 0
    if num_drafts:
        draft_ids = torch.tensor(draft_token_ids, dtype=torch.long, device=device)  # [k]
        rows = torch.arange(num_drafts, device=device)
        target_draft_probs = target_probs[rows, draft_ids]  # [k]
        assert draft_probs.shape == (num_drafts, target_probs.shape[-1]), (
            f"draft_probs {tuple(draft_probs.shape)} for target_probs {tuple(target_probs.shape)}"
        )
        draft_probs = draft_probs.to(device=device, dtype=target_probs.dtype)
        draft_draft_probs = draft_probs[rows, draft_ids]  # [k]
        uniforms = _uniforms(num_drafts, generator, device, first_row=0, purpose=ACCEPT)  # [k]
        # u < min(1, target/draft), written without dividing by a draft probability of 0.
        accepted = uniforms * draft_draft_probs.double() < target_draft_probs.double()  # [k]
        num_accepted = int(accepted.long().cumprod(dim=0).sum())
    if num_accepted == num_drafts:
        bonus_id = sample_token(target_probs[num_drafts], generator, num_drafts)
        return list(draft_token_ids) + [bonus_id]
    target_row = target_probs[num_accepted]  # [vocab]
    residual = (target_row - draft_probs[num_accepted]).clamp_(min=0.0)
    # All zero only when target_row <= the draft row everywhere, i.e. the two are equal and
    # every draft is accepted; rounding could still land here, so fall back to target_row.
    residual = torch.where(residual.sum() > 0, residual, target_row)
    recovered_id = sample_token(residual, generator, num_accepted)
    return list(draft_token_ids[:num_accepted]) + [recovered_id]


def _uniforms(num_uniforms: int, generator: RandomSource, device: torch.device, first_row: int,
              purpose: int = SAMPLE) -> Tensor:
    """[num_uniforms] float64 uniforms in [0, 1) on `device` for rows first_row, first_row + 1,
    ...: from each row's own generator (`PositionRandom`), or drawn from `generator` in turn.

    A request's generator may live on the CPU while the logits sit on an accelerator: draw
    where the generator lives, then move, so a seed gives the same draws on every device.
    """
    if isinstance(generator, PositionRandom):
        draws = [torch.rand(1, generator=generator.generator(first_row + i, purpose), dtype=torch.float64)
                 for i in range(num_uniforms)]
        return torch.cat(draws).to(device)
    source_device = generator.device if generator is not None else device
    return torch.rand(num_uniforms, generator=generator, device=source_device, dtype=torch.float64).to(device)


def sample_token(weights: Tensor, generator: RandomSource, row: int) -> int:
    """One token id drawn with probability proportional to `weights` [vocab] (>= 0, sum > 0).

    Inverse CDF in float64: one uniform and a binary search. On CPU this is ~17x faster than
    `torch.multinomial` at a 49k vocabulary. A zero-weight id is never drawn: its cumulative
    sum equals its predecessor's, so the search stops at or before the predecessor.
    """
    cumulative = weights.double().cumsum(dim=0)  # [vocab]
    uniform = _uniforms(1, generator, weights.device, first_row=row)  # [1]
    token_id = torch.searchsorted(cumulative, uniform * cumulative[-1], right=True)  # [1]
    return int(token_id.clamp_(max=weights.shape[0] - 1))
