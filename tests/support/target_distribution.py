"""The target distribution a verify step samples from, computed apart from the rejection
sampler (process_logits, then a softmax, or one-hot on the argmax for a greedy request):
the reference the sampler's statistical tests compare its output with."""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.engine.logits_processor import argmax_rows, process_logits
from specdec.engine.sampling_params import SamplingParams


def target_probs_from_logits(
    logits: Tensor,
    history_ids: list[int],
    draft_token_ids: list[int],
    params: SamplingParams,
    *,
    prompt_len: int | None = None,
    eos_token_ids: frozenset[int] | tuple[int, ...] = (),
) -> Tensor:
    """The target distribution at each position: [n, vocab] float32, rows summing to 1.

    Same arguments as `process_logits`. For a greedy request the distribution is one-hot on
    the argmax of the steps 1-3 logits (the limit of temperature -> 0).
    """
    processed = process_logits(
        logits, history_ids, draft_token_ids, params, prompt_len=prompt_len, eos_token_ids=eos_token_ids
    )  # [n, vocab]
    if params.is_greedy:
        target_probs = torch.zeros_like(processed)
        return target_probs.scatter_(-1, argmax_rows(processed).unsqueeze(-1), 1.0)
    return processed.softmax(dim=-1)
