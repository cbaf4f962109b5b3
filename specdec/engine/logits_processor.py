"""Raw target logits -> the target distribution of one sequence's verify step.

A verify step scores n = k + 1 positions of one sequence at once: position 0 follows the last
verified token, position i follows draft token i - 1. The processing is vLLM's, in its order:

1. repetition penalty (also for greedy requests): every token id in the context seen by a
   position (prompt, output so far, and the drafts before that position) has its logit
   divided by the penalty when positive, multiplied by it otherwise (HF/vLLM semantics);
2. for sampled requests only: temperature, then top-k, then top-p.

Masked entries are -inf, so `softmax` gives the target distribution `target_probs` that the
rejection sampler verifies drafts against. Temperature, top-k and top-p never move the
argmax, so a greedy request only needs step 1.
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


def apply_temperature_top_k_top_p(logits: Tensor, params: SamplingParams) -> Tensor:
    """Scale by temperature, then mask to -inf what top-k and then top-p exclude.

    logits: [n, vocab], for a sampled (not greedy) request. Top-k keeps exactly k tokens per
    row (ties broken by sort order, as vLLM). Top-p keeps the smallest set of most likely
    tokens whose probability (after top-k) sums to at least top_p, and always the most likely.
    """
    assert not params.is_greedy, "temperature/top-k/top-p are for sampled requests"
    logits = logits / params.temperature
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
) -> Tensor:
    """The processed logits of one verify step: penalty, then temperature/top-k/top-p if sampled.

    logits: [n, vocab], raw from the target model. history_ids: prompt + output so far, the
    context before position 0. draft_token_ids: n - 1 or n ids; draft i joins the context of
    position i + 1 (a draft past the last position is ignored). Returns [n, vocab] float32,
    masked entries at -inf. For greedy requests only the penalty applies.
    """
    assert logits.dim() == 2, f"logits must be [n, vocab], got {tuple(logits.shape)}"
    num_positions = logits.shape[0]
    assert len(draft_token_ids) in (num_positions - 1, num_positions), (
        f"{len(draft_token_ids)} draft ids for {num_positions} positions"
    )
    logits = logits.float()
    logits = apply_repetition_penalty(logits, history_ids, draft_token_ids, params.repetition_penalty)
    if params.is_greedy:
        return logits
    return apply_temperature_top_k_top_p(logits, params)


def target_probs_from_logits(
    logits: Tensor,
    history_ids: list[int],
    draft_token_ids: list[int],
    params: SamplingParams,
) -> Tensor:
    """The target distribution at each position: [n, vocab] float32, rows summing to 1.

    Same arguments as `process_logits`. For a greedy request the distribution is one-hot on
    the argmax of the penalised logits (the limit of temperature -> 0).
    """
    processed = process_logits(logits, history_ids, draft_token_ids, params)  # [n, vocab]
    if params.is_greedy:
        target_probs = torch.zeros_like(processed)
        return target_probs.scatter_(-1, argmax_rows(processed).unsqueeze(-1), 1.0)
    return processed.softmax(dim=-1)


def argmax_rows(logits: Tensor) -> Tensor:
    """Each row's argmax over the last dimension (int64, on `logits`' device): the first
    maximal index, a NaN counting as maximal, as `torch.argmax` gives it. float32 / float64
    on the CPU go through numpy: torch's CPU argmax walks a row in scalar code, 95 us for
    the default model's 49,152 logits here against numpy's 6 us (8 rows: 347 against 35 us,
    ~2.5% of an eight-sequence decode step)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64):
        return logits.argmax(dim=-1)
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
