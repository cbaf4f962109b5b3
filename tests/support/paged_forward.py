"""A model's forward through the paged KV cache without the scheduler, and transformers'
logits to compare it with: small, non-contiguous blocks chosen by the test."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionMetadata
from specdec.models import LlamaForCausalLM

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@dataclass
class PagedSequence:
    """A test-side stand-in for the scheduler: a block table and how much is cached."""

    block_ids: list[int]
    num_cached: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


def run_step(model: LlamaForCausalLM, kv_cache: KVCache, work: list[tuple[PagedSequence, list[int]]],
             device: torch.device, aux_layer_ids: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """One flat-batch forward over `work` (sequence, new token ids); returns per-sequence logits."""
    block_size = kv_cache.block_size
    input_ids, positions, slots, starts, context_lens = [], [], [], [0], []
    for seq, token_ids in work:
        for offset, token_id in enumerate(token_ids):
            position = seq.num_cached + offset
            input_ids.append(token_id)
            positions.append(position)
            slots.append(seq.block_ids[position // block_size] * block_size + position % block_size)
        starts.append(starts[-1] + len(token_ids))
        context_lens.append(seq.num_cached + len(token_ids))
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_locs=starts,
        context_lens=context_lens,
        block_tables=[torch.tensor(seq.block_ids, dtype=torch.int64, device=device) for seq, _ in work],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                       kv_cache, metadata, aux_layer_ids)
        if aux_layer_ids:
            hidden, _ = hidden
        logits = model.compute_logits(hidden).cpu()
    out = []
    for index, (seq, token_ids) in enumerate(work):
        seq.num_cached += len(token_ids)
        seq_logits = logits[starts[index]:starts[index + 1]]
        seq.logits.append(seq_logits)
        out.append(seq_logits)
    return out


def reversed_blocks(count: int, first: int) -> list[int]:
    """Block ids running backwards, so every block table is non-contiguous."""
    return list(range(first + count - 1, first - 1, -1))


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def prompt(length: int, seed: int, vocab_size: int = 97) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_cache(model: LlamaForCausalLM, device: torch.device) -> KVCache:
    return KVCache.allocate(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, device)
