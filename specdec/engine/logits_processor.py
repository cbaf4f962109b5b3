"""Raw target logits -> the target distribution of one sequence's verify step.

A verify step scores n = k + 1 positions of one sequence at once: position 0 follows the last
verified token, position i follows draft token i - 1. Each position is processed as if the
drafts before it were already output. The order is vLLM v1's sampler order:

1. logit_bias: the request's bias added to each named token's logit;
2. min_tokens: while fewer than min_tokens tokens have been output (drafts before the
   position count), EOS (unless ignore_eos) and stop_token_ids are set to -inf;
3. penalties, in this order:
   a. repetition penalty: every token id in the position's context (prompt, output so far
      and the drafts before it) has its logit divided by the penalty when positive,
      multiplied by it otherwise (HF/vLLM semantics);
   b. frequency and presence penalties (OpenAI), over the generated tokens only (output so
      far and the drafts before the position, never the prompt):
      logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0);
4. for sampled requests only: temperature, then min_p (drop tokens whose probability is
   below min_p times the largest), then top-k, then top-p.

Steps 1 and 2 commute (a bias never lifts -inf). Masked entries are -inf, so `softmax` gives
the target distribution `target_probs` that the rejection sampler verifies drafts against.
Step 4 never moves the argmax, so a greedy request only needs steps 1-3.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specdec.engine.sampling_params import SamplingParams


def apply_repetition_penalty(
    logits: Tensor,
    history_ids: list[int],
    draft_token_ids: list[int],
    penalty: float,
) -> Tensor:
    """Penalise, per position, the token ids already in that position's context.

    logits: [n, vocab]. Position i sees `history_ids` plus `draft_token_ids[:i]`. Only the
    columns of ids in some context are touched (gather, where, scatter over a unique-id index),
    so the cost is O(n * unique ids), never a loop over the vocabulary. Returns a new tensor.
    """
    num_positions = logits.shape[0]
    visible_draft_ids = draft_token_ids[: num_positions - 1]
    if penalty == 1.0 or not (history_ids or visible_draft_ids):
        return logits
    device = logits.device
    context_ids = torch.tensor(history_ids + visible_draft_ids, dtype=torch.long, device=device)  # [c]
    # The first position whose context holds each id: 0 for history ids, i + 1 for draft i.
    context_positions = torch.cat(
        [
            torch.zeros(len(history_ids), dtype=torch.long, device=device),
            torch.arange(1, len(visible_draft_ids) + 1, dtype=torch.long, device=device),
        ]
    )  # [c]
    unique_ids, inverse = torch.unique(context_ids, return_inverse=True)  # [u], [c]
    first_position = torch.full((unique_ids.numel(),), num_positions, dtype=torch.long, device=device)
    first_position.scatter_reduce_(0, inverse, context_positions, reduce="amin")  # [u]
    seen = torch.arange(num_positions, device=device)[:, None] >= first_position[None, :]  # [n, u]
    columns = logits[:, unique_ids]  # [n, u]
    penalised = torch.where(columns > 0, columns / penalty, columns * penalty)
    penalised_logits = logits.clone()
    penalised_logits[:, unique_ids] = torch.where(seen, penalised, columns)
    return penalised_logits


def apply_logit_bias(logits: Tensor, logit_bias: tuple[tuple[int, float], ...]) -> Tensor:
    """Adds each (token id, bias) to that column of every row. Returns a new tensor."""
    if not logit_bias:
        return logits
    token_ids = torch.tensor([token_id for token_id, _ in logit_bias], dtype=torch.long, device=logits.device)
    biases = torch.tensor([bias for _, bias in logit_bias], dtype=logits.dtype, device=logits.device)
    biased = logits.clone()
    biased[:, token_ids] += biases  # ids are unique (SamplingParams), so += is well defined
    return biased


def apply_min_tokens(
    logits: Tensor, num_output_tokens: int, min_tokens: int, stop_ids: frozenset[int] | tuple[int, ...]
) -> Tensor:
    """Masks `stop_ids` to -inf at positions with fewer than min_tokens tokens output.

    Position i has `num_output_tokens + i` tokens output before it (the drafts before it
    count). Ids outside the vocabulary cannot be emitted anyway and are skipped.
    """
    num_positions, vocab_size = logits.shape
    num_masked_rows = min(num_positions, max(0, min_tokens - num_output_tokens))
    masked_ids = sorted(token_id for token_id in stop_ids if token_id < vocab_size)
    if num_masked_rows == 0 or not masked_ids:
        return logits
    masked = logits.clone()
    ids = torch.tensor(masked_ids, dtype=torch.long, device=logits.device)
    masked[:num_masked_rows, ids] = float("-inf")
    return masked


def apply_frequency_presence_penalties(
    logits: Tensor,
    output_ids: list[int],
    draft_token_ids: list[int],
    frequency_penalty: float,
    presence_penalty: float,
) -> Tensor:
    """OpenAI's penalties per position, over the tokens output before it.

    logits: [n, vocab]. Position i counts `output_ids` plus `draft_token_ids[:i]`. Only the
    columns of counted ids are touched, so the cost is O(n * unique ids). Returns a new tensor.
    """
    num_positions = logits.shape[0]
    visible_draft_ids = draft_token_ids[: num_positions - 1]
    if (frequency_penalty == 0.0 and presence_penalty == 0.0) or not (output_ids or visible_draft_ids):
        return logits
    device = logits.device
    unique_ids, inverse = torch.unique(
        torch.tensor(output_ids + visible_draft_ids, dtype=torch.long, device=device), return_inverse=True
    )  # [u], [c]
    num_unique = unique_ids.numel()
    base_counts = torch.zeros(num_unique, dtype=logits.dtype, device=device)
    base_counts.index_add_(0, inverse[: len(output_ids)],
                           torch.ones(len(output_ids), dtype=logits.dtype, device=device))
    # Row i + 1 of the draft counts holds draft i; a cumulative sum makes row i count drafts[:i].
    draft_counts = torch.zeros(num_positions, num_unique, dtype=logits.dtype, device=device)  # [n, u]
    if visible_draft_ids:
        rows = torch.arange(1, len(visible_draft_ids) + 1, device=device)
        draft_counts.index_put_((rows, inverse[len(output_ids):]),
                                torch.ones(len(rows), dtype=logits.dtype, device=device))
    counts = base_counts[None, :] + draft_counts.cumsum(dim=0)  # [n, u]
    penalised = logits.clone()
    penalised[:, unique_ids] -= frequency_penalty * counts + presence_penalty * (counts > 0).to(logits.dtype)
    return penalised


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Masks to -inf the tokens whose probability is below min_p times the row's largest."""
    if min_p == 0.0:
        return logits
    probs = logits.softmax(dim=-1)  # [n, vocab]
    threshold = min_p * probs.amax(dim=-1, keepdim=True)  # [n, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_temperature_top_k_top_p(logits: Tensor, params: SamplingParams) -> Tensor:
    """Scale by temperature, then mask to -inf what min_p, top-k and then top-p exclude.

    logits: [n, vocab], for a sampled (not greedy) request. Top-k keeps exactly k tokens per
    row (ties broken by sort order, as vLLM). Top-p keeps the smallest set of most likely
    tokens whose probability (after top-k) sums to at least top_p, and always the most likely.
    """
    assert not params.is_greedy, "temperature/top-k/top-p are for sampled requests"
    logits = apply_min_p(logits / params.temperature, params.min_p)
    vocab_size = logits.shape[-1]
    use_top_k = params.top_k != -1 and params.top_k < vocab_size
    use_top_p = params.top_p < 1.0
    if not (use_top_k or use_top_p):
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)  # [n, vocab] each, ascending
    if use_top_k:
        # Ascending order: all but the last top_k entries fall outside the top k.
        sorted_logits[:, : vocab_size - params.top_k] = float("-inf")
    if use_top_p:
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [n, vocab]
        # A token goes when the less likely tokens, itself included, hold <= 1 - top_p: what
        # remains is the smallest most-likely set holding >= top_p.
        outside_top_p = cumulative_probs <= 1.0 - params.top_p
        outside_top_p[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(outside_top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def process_logits(
    logits: Tensor,
    history_ids: list[int],
    draft_token_ids: list[int],
    params: SamplingParams,
    *,
    prompt_len: int | None = None,
    eos_token_ids: frozenset[int] | tuple[int, ...] = (),
) -> Tensor:
    """The processed logits of one verify step, in the module's order.

    logits: [n, vocab], raw from the target model. history_ids: prompt + output so far, the
    context before position 0. draft_token_ids: n - 1 or n ids; draft i joins the context of
    position i + 1 (a draft past the last position is ignored). prompt_len: how many of
    history_ids are the prompt (the rest is output, what presence/frequency penalties and
    min_tokens count); None means all of them. eos_token_ids: what min_tokens masks besides
    stop_token_ids (unless ignore_eos). Returns [n, vocab] float32, masked entries at -inf.
    For greedy requests only steps 1-3 apply.
    """
    assert logits.dim() == 2, f"logits must be [n, vocab], got {tuple(logits.shape)}"
    num_positions = logits.shape[0]
    assert len(draft_token_ids) in (num_positions - 1, num_positions), (
        f"{len(draft_token_ids)} draft ids for {num_positions} positions"
    )
    logits = logits.float()
    num_prompt_tokens = len(history_ids) if prompt_len is None else prompt_len
    logits = apply_logit_bias(logits, params.logit_bias)
    if params.min_tokens:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        logits = apply_min_tokens(logits, len(history_ids) - num_prompt_tokens, params.min_tokens, tuple(stop_ids))
    logits = apply_repetition_penalty(logits, history_ids, draft_token_ids, params.repetition_penalty)
    logits = apply_frequency_presence_penalties(
        logits, history_ids[num_prompt_tokens:], draft_token_ids, params.frequency_penalty, params.presence_penalty
    )
    if params.is_greedy:
        return logits
    return apply_temperature_top_k_top_p(logits, params)


def argmax_rows(logits: Tensor) -> Tensor:
    """Each row's argmax over the last dimension (int64, on `logits`' device): the first
    maximal index, a NaN counting as maximal, as `torch.argmax` gives it. float32 / float64
    on the CPU go through numpy: torch's CPU argmax walks a row in scalar code, 95 us for
    the default model's 49,152 logits here against numpy's 6 us (8 rows: 347 against 35 us,
    ~2.5% of an eight-sequence decode step)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64):
        return logits.argmax(dim=-1)
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
