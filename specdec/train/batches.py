"""Padded training batches cut from a `FeatureSet`, and the distillation loss on them.

A batch holds B whole conversations (cropped to `max_len`), right-padded to T tokens.
*Label row* q of a sequence is the target's top-K at position q, i.e. its prediction of
token q + 1; rows q >= prompt_len - 1 (the answer) carry loss, prompt rows do not, since
drafting only happens after the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.train.features import FeatureSet


@dataclass
class Batch:
    token_ids: torch.Tensor  # [B, T] int64, 0 past each sequence's end
    aux: torch.Tensor  # [B, T, A * H] float32
    final: torch.Tensor  # [B, T, H] float32
    topk_ids: torch.Tensor  # [B, T, K] int64
    topk_logits: torch.Tensor  # [B, T, K] float32
    loss_rows: torch.Tensor  # [B, T] bool: label rows that carry loss
    lengths: torch.Tensor  # [B] int64


def make_batch(features: FeatureSet, seq_indices: list[int], max_len: int,
               with_features: bool = True) -> Batch:
    spans = []
    for index in seq_indices:
        start = int(features.seq_starts[index])
        end = min(int(features.seq_starts[index + 1]), start + max_len)
        spans.append((start, end, int(features.prompt_lens[index])))
    num_rows, width = len(spans), max(end - start for start, end, _ in spans)
    token_ids = torch.zeros(num_rows, width, dtype=torch.int64)
    top_k = features.topk_ids.shape[1]
    topk_ids = torch.zeros(num_rows, width, top_k, dtype=torch.int64)
    topk_logits = torch.zeros(num_rows, width, top_k)
    loss_rows = torch.zeros(num_rows, width, dtype=torch.bool)
    aux = torch.zeros(num_rows, width, features.aux.shape[1] if with_features else 0)
    final = torch.zeros(num_rows, width, features.final.shape[1] if with_features else 0)
    for row, (start, end, prompt_len) in enumerate(spans):
        length = end - start
        token_ids[row, :length] = features.token_ids[start:end]
        topk_ids[row, :length] = features.topk_ids[start:end]
        topk_logits[row, :length] = features.topk_logits[start:end]
        loss_rows[row, max(prompt_len - 1, 0):length] = True
        if with_features:
            aux[row, :length] = features.aux[start:end].float()
            final[row, :length] = features.final[start:end].float()
    lengths = torch.tensor([end - start for start, end, _ in spans])
    return Batch(token_ids, aux, final, topk_ids, topk_logits, loss_rows, lengths)


def shift_rows(tensor: torch.Tensor, shift: int) -> torch.Tensor:
    """`out[:, t] = tensor[:, t + shift]`, zero (False) past the end."""
    if shift == 0:
        return tensor
    out = torch.zeros_like(tensor)
    if shift < tensor.shape[1]:
        out[:, :-shift] = tensor[:, shift:]
    return out


class VocabMap:
    """Target ids <-> indices of the loss vocabulary (a sorted subset of target ids)."""

    def __init__(self, vocab_ids: torch.Tensor, vocab_size: int) -> None:
        self.vocab_ids = vocab_ids  # [V_loss] target ids, increasing
        self.index_of = torch.full((vocab_size,), -1, dtype=torch.int64)
        self.index_of[vocab_ids] = torch.arange(vocab_ids.shape[0])


def scored_rows(rows: torch.Tensor, topk_ids: torch.Tensor, vocab: VocabMap | None) -> torch.Tensor:
    """[B, T] bool: rows that carry loss and whose target top-1 the draft can propose."""
    if vocab is None:
        return rows
    return rows & (vocab.index_of[topk_ids[..., 0]] >= 0)


def distill_loss(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logits: torch.Tensor,
                 vocab: VocabMap | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy against the target's top-K, over the draft's vocabulary, summed.

    logits [R, V_draft] for R scored rows (see `scored_rows`; computing logits only there
    saves most of the output projection); topk_* [R, K]. Target tokens outside the draft
    vocabulary are dropped and the rest renormalised (a draft cannot propose them).
    Returns (summed loss, number of rows where the draft's argmax is the target's top-1:
    what greedy verification accepts).
    """
    indices = topk_ids if vocab is None else vocab.index_of[topk_ids]  # [R, K], -1 outside
    inside = indices >= 0
    if logits.shape[0] == 0:
        return logits.sum() * 0.0, torch.zeros((), dtype=torch.int64)
    target_probs = torch.softmax(topk_logits.masked_fill(~inside, float("-inf")), dim=-1)
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, indices.clamp(min=0))
    loss = -(target_probs * log_probs.masked_fill(~inside, 0.0)).sum()
    correct = (logits.argmax(-1) == indices[:, 0]).sum()
    return loss, correct
