"""Log-probabilities of emitted tokens, from the verify forward's own logits.

A verify step of one sequence scores k + 1 positions; the tokens it emits (accepted drafts,
then the recovered or bonus token) are scored by rows 0..a of those logits, each row
computed with the drafts before it in context, exactly the context plain decoding would
have given that position. So the log-probabilities reported under speculation are those
of decoding without it: the same logits, read at the same positions.

Modes (vLLM's `--logprobs-mode`):
- raw_logprobs: log_softmax of the model's logits, before any sampling parameter;
- processed_logprobs: log_softmax after the request's processing (`process_logits`:
  bias, min_tokens, penalties, and for sampled requests temperature, min_p, top-k, top-p);
  excluded tokens have -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.engine.logits_processor import process_logits
from specdec.engine.sampling_params import SamplingParams




@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One emitted token's log-probability and its position's most likely tokens."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def token_logprobs(logits: Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """logits: [m, vocab] (raw or processed), row i scoring token_ids[i]; one entry per row.
    Top entries are sorted, most likely first (ties by lower id, as torch.topk on CPU)."""
    rows = len(token_ids)
    assert logits.shape[0] >= rows
    logprobs = torch.log_softmax(logits[:rows].float(), dim=-1)  # [m, vocab]
    chosen = logprobs[torch.arange(rows, device=logprobs.device),
                      torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)].tolist()
    if num_top == 0:
        return [TokenLogprobs(value) for value in chosen]
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [m, num_top] each, descending
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(chosen[row], tuple(top_ids_list[row]), tuple(top_values_list[row]))
            for row in range(rows)]


def step_logprobs(logits: Tensor, emitted_ids: list[int], history_ids: list[int],
                  params: SamplingParams, mode: str, *, prompt_len: int,
                  eos_token_ids: frozenset[int] | tuple[int, ...]) -> list[TokenLogprobs]:
    """The entries for one verify step's emitted tokens. logits: the step's rows for the
    sequence ([k + 1, vocab], raw); history_ids: the context before row 0."""
    assert params.logprobs is not None
    rows = logits[:len(emitted_ids)]
    if mode == "processed_logprobs":
        rows = process_logits(rows, history_ids, emitted_ids[:-1], params,
                              prompt_len=prompt_len, eos_token_ids=eos_token_ids)
    return token_logprobs(rows, emitted_ids, params.logprobs)
