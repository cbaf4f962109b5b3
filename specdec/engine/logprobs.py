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


# Top-k in two passes: the maximum of each chunk of this many logits, then the exact top-k
# among the chunks holding the k largest maxima (they hold the k largest logits). At the
# default model's 49,152 logits it is ~7x faster than torch.topk on the CPU (16 rows:
# 0.13 against 0.94 ms), which kept logprobs at batch 16 from costing 18% of a step.
TOPK_CHUNK = 128


def top_k(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest values of each row, descending, and their ids: [rows, k] each."""
    num_rows, vocab_size = logits.shape
    if vocab_size <= k * TOPK_CHUNK:
        return logits.topk(k, dim=-1)
    pad = -vocab_size % TOPK_CHUNK
    padded = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    chunks = padded.view(num_rows, -1, TOPK_CHUNK)  # [rows, n_chunks, chunk]
    chunk_ids = chunks.amax(dim=-1).topk(k, dim=-1).indices  # [rows, k]
    candidates = chunks.gather(1, chunk_ids[:, :, None].expand(num_rows, k, TOPK_CHUNK))
    values, positions = candidates.reshape(num_rows, k * TOPK_CHUNK).topk(k, dim=-1)
    ids = chunk_ids.gather(1, positions // TOPK_CHUNK) * TOPK_CHUNK + positions % TOPK_CHUNK
    return values, ids


def token_logprobs(logits: Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """logits: [m, vocab] (raw or processed), row i scoring token_ids[i]; one entry per row,
    with the row's `num_top` most likely tokens, most likely first."""
    return batch_token_logprobs(logits, [(0, token_ids, num_top)])[0]


def batch_token_logprobs(logits: Tensor, groups: list[tuple[int, list[int], int]],
                         ) -> list[list[TokenLogprobs]]:
    """Several sequences' entries in one pass over their rows: each group is (first row,
    the tokens its rows score, how many top entries). One log-softmax and one top-k for
    the whole step, rather than one of each per sequence."""
    # torch's log_softmax kernel is the fastest full pass measured here (16 rows of 49,152:
    # 0.32-0.46 ms, against 0.47-1.05 for logsumexp), converting to fp32 as it reads. Rows
    # that follow each other (every sequence of a decode step asking) are a slice, not a
    # gather (0.23 ms for 16 rows).
    firsts = [first for first, _, _ in groups]
    counts = [len(ids) for _, ids, _ in groups]
    start = firsts[0]
    if all(first == start + sum(counts[:index]) for index, first in enumerate(firsts)):
        selected = logits[start:start + sum(counts)]
    else:
        rows = torch.cat([torch.arange(first, first + count) for first, count in zip(firsts, counts)])
        selected = logits[rows.to(logits.device)]
    logprobs = torch.log_softmax(selected, dim=-1, dtype=torch.float32)  # [r, vocab]
    token_ids = torch.tensor([token for _, ids, _ in groups for token in ids],
                             dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0].tolist()
    num_top = max(top for _, _, top in groups)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if num_top:
        values, indices = top_k(logprobs, num_top)
        top_values, top_ids = values.tolist(), indices.tolist()
    results: list[list[TokenLogprobs]] = []
    row = 0
    for _, ids, top in groups:
        entries = []
        for _ in ids:
            if top:
                entries.append(TokenLogprobs(chosen[row], tuple(top_ids[row][:top]),
                                             tuple(top_values[row][:top])))
            else:
                entries.append(TokenLogprobs(chosen[row]))
            row += 1
        results.append(entries)
    return results


@dataclass(frozen=True, slots=True)
class LogprobsJob:
    """One sequence's emitted tokens of a step, waiting for their logprobs."""

    first_row: int  # the row of the step's logits that scored emitted_ids[0]
    emitted_ids: list[int]
    history_ids: list[int]  # the context before that row
    params: SamplingParams
    prompt_len: int


def step_logprobs(logits: Tensor, jobs: list[LogprobsJob], mode: str,
                  eos_token_ids: frozenset[int] | tuple[int, ...]) -> list[list[TokenLogprobs]]:
    """The entries of every job of one step. logits: the step's raw rows [rows, vocab]."""
    if mode != "processed_logprobs":
        return batch_token_logprobs(logits, [(job.first_row, job.emitted_ids, job.params.logprobs or 0)
                                             for job in jobs])
    processed = [process_logits(logits[job.first_row:job.first_row + len(job.emitted_ids)],
                                job.history_ids, job.emitted_ids[:-1], job.params,
                                prompt_len=job.prompt_len, eos_token_ids=eos_token_ids)
                 for job in jobs]
    groups, first = [], 0
    for job, rows in zip(jobs, processed):
        groups.append((first, job.emitted_ids, job.params.logprobs or 0))
        first += rows.shape[0]
    return batch_token_logprobs(torch.cat(processed), groups)
