"""Target features for training drafts, computed once and cached.

For every token of every self-distilled conversation (prompt + answer) one forward of the
target (our `LlamaForCausalLM`, teacher-forced, fp32) records:

- `aux` [N, len(aux_layer_ids) * H]: the residual stream entering the given target layers
  (EAGLE-3's low / mid / high features; `forward(aux_layer_ids=...)`);
- `final` [N, H]: the final normed hidden state (EAGLE-1's feature);
- `topk_ids` / `topk_logits` [N, K]: the target's K most likely next tokens at each
  position, the labels every draft is distilled on (the top-1 is what greedy verification
  accepts; the rest shape the distribution for sampled requests).

Sequences are concatenated; `seq_starts` [S + 1] and `prompt_lens` [S] delimit them.
Features are kept in bfloat16 (half the memory; they are inputs and soft targets, not
weights).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionMetadata
from specdec.models.llama import LlamaForCausalLM
from specdec.train.progress import Progress

logger = logging.getLogger(__name__)

FEATURE_DTYPE = torch.bfloat16


@dataclass
class FeatureSet:
    """Everything a draft trainer reads; see the module docstring for shapes."""

    token_ids: torch.Tensor  # [N] int64
    seq_starts: torch.Tensor  # [S + 1] int64
    prompt_lens: torch.Tensor  # [S] int64
    aux: torch.Tensor  # [N, A * H] bfloat16
    final: torch.Tensor  # [N, H] bfloat16
    topk_ids: torch.Tensor  # [N, K] int64
    topk_logits: torch.Tensor  # [N, K] float32
    aux_layer_ids: tuple[int, ...]

    @property
    def num_sequences(self) -> int:
        return int(self.prompt_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def save(self, path: Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(path) + ".tmp")
        torch.save({name: getattr(self, name) for name in self.__dataclass_fields__}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> FeatureSet:
        # Memory-mapped: trainers of several drafts running at once share one copy in the
        # page cache (a million tokens of features is a few GiB).
        return cls(**torch.load(path, map_location="cpu", weights_only=True, mmap=True))


def _prefill(model: LlamaForCausalLM, sequences: list[list[int]], aux_layer_ids: tuple[int, ...],
             block_size: int = 16) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One teacher-forced forward over several sequences, each in its own fresh cache blocks."""
    lengths = [len(ids) for ids in sequences]
    blocks_per_seq = [-(-length // block_size) for length in lengths]
    kv_cache = KVCache.allocate(model.config, sum(blocks_per_seq), block_size, torch.float32,
                                torch.device("cpu"))
    block_tables, first_block, starts = [], 0, [0]
    for count, length in zip(blocks_per_seq, lengths):
        block_tables.append(torch.arange(first_block, first_block + count))
        first_block += count
        starts.append(starts[-1] + length)
    slots = torch.cat([table[torch.arange(length) // block_size] * block_size + torch.arange(length) % block_size
                       for table, length in zip(block_tables, lengths)])
    metadata = AttentionMetadata(slot_mapping=slots, query_start_locs=starts, context_lens=lengths,
                                 block_tables=block_tables)
    input_ids = torch.tensor([token for ids in sequences for token in ids], dtype=torch.int64)
    positions = torch.cat([torch.arange(length) for length in lengths])
    hidden, aux = model(input_ids, positions, kv_cache, metadata, aux_layer_ids=aux_layer_ids)
    return hidden, aux


@torch.inference_mode()
def extract_features(model: LlamaForCausalLM, records: list[dict], aux_layer_ids: tuple[int, ...],
                     top_k: int = 8, tokens_per_batch: int = 2048, max_len: int = 1024) -> FeatureSet:
    """Runs the target over every record (prompt_ids + output_ids); see the module docstring."""
    sequences = [(record["prompt_ids"] + record["output_ids"])[:max_len] for record in records]
    prompt_lens = [min(len(record["prompt_ids"]), max_len) for record in records]
    parts: dict[str, list[torch.Tensor]] = {"aux": [], "final": [], "topk_ids": [], "topk_logits": []}
    progress = Progress("features", total=sum(len(ids) for ids in sequences), unit="tokens")
    batch: list[list[int]] = []

    def flush() -> None:
        hidden, aux = _prefill(model, batch, aux_layer_ids)
        parts["aux"].append(torch.cat(aux, dim=-1).to(FEATURE_DTYPE))
        parts["final"].append(hidden.to(FEATURE_DTYPE))
        for chunk in hidden.split(512):
            logits = model.compute_logits(chunk)  # [<=512, vocab] float32
            values, ids = logits.topk(top_k, dim=-1)
            parts["topk_ids"].append(ids)
            parts["topk_logits"].append(values)
        progress.update(sum(len(ids) for ids in batch))
        batch.clear()

    for ids in sequences:
        if batch and sum(len(b) for b in batch) + len(ids) > tokens_per_batch:
            flush()
        batch.append(ids)
    if batch:
        flush()
    progress.close()
    lengths = torch.tensor([len(ids) for ids in sequences], dtype=torch.int64)
    return FeatureSet(
        token_ids=torch.tensor([token for ids in sequences for token in ids], dtype=torch.int64),
        seq_starts=torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))),
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.int64),
        aux=torch.cat(parts["aux"]), final=torch.cat(parts["final"]),
        topk_ids=torch.cat(parts["topk_ids"]), topk_logits=torch.cat(parts["topk_logits"]),
        aux_layer_ids=tuple(aux_layer_ids))


def token_frequencies(features: FeatureSet, vocab_size: int) -> torch.Tensor:
    """[vocab] counts of the target's top-1 next tokens over answer positions (what drafts must say)."""
    mask = torch.zeros(features.num_tokens, dtype=torch.bool)
    for start, prompt_len, end in zip(features.seq_starts[:-1].tolist(), features.prompt_lens.tolist(),
                                      features.seq_starts[1:].tolist()):
        mask[start + max(prompt_len - 1, 0):end] = True
    counts = torch.bincount(features.topk_ids[mask, 0], minlength=vocab_size)
    counts += torch.bincount(features.token_ids, minlength=vocab_size)  # the inputs' tokens too
    return counts


def choose_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent target ids, sorted, as EAGLE-3's (d2t, t2d).

    Target id of draft id i = i + d2t[i]; t2d[t] is True iff target id t is in the draft
    vocabulary. Ties (zero counts when data is scarce) go to the lowest ids, deterministically.
    """
    vocab_size = counts.shape[0]
    draft_vocab_size = min(draft_vocab_size, vocab_size)
    order = torch.argsort(-counts, stable=True)
    chosen = order[:draft_vocab_size].sort().values  # [draft_vocab] target ids, increasing
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d
