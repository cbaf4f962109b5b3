"""Paged attention's per-step metadata and the interface every backend implements.

Terms:
- *flat batch*: the input tokens of all scheduled sequences concatenated into one
  `[num_tokens]` vector; a sequence contributes a prefill chunk, one decode token, or
  1 + k tokens to verify.
- *context length*: how many tokens of a sequence the cache holds once this step's tokens are
  written. Query token j of sequence i (query length q_i) sits at position
  `context_lens[i] - q_i + j` and attends causally to cache positions `[0, that position]`
  (a bottom-right aligned causal mask).
- *tree segment*: a sequence's query tokens given `tree_parents`, a verify window whose
  drafts branch (tree drafts). Token j's parent is the segment's token `parents[j]` (before
  it), or -1 for none: it follows the cached prefix, i.e. positions
  `[0, context_len - query_len)`. Token j attends to that prefix and to its path, its
  ancestors and itself, and nothing else: as a decode of that path would. The caller gives it
  the position of prefix length + its depth (the number of its ancestors); its K/V still goes
  to its own slot, and the verifier moves the accepted path's K/V into place after.

Faster backends (fused NPU attention, CUDA kernels) implement `AttentionBackend` and are
tested against `TorchPagedAttention`, which uses plain torch ops only so that it runs on
cpu, cuda and npu.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each one may attend to."""

    # [num_tokens] int64: cache slot (block_id * block_size + offset) where each input token's K/V is written
    slot_mapping: torch.Tensor
    # [num_seqs + 1]; sequence i's input tokens are input[query_start_locs[i]:query_start_locs[i+1]]
    query_start_locs: list[int]
    # [num_seqs]: tokens in sequence i's cache once this step's tokens are written (= last query position + 1)
    context_lens: list[int]
    block_tables: list[torch.Tensor]  # per sequence int64 [num_blocks_i], enough blocks to cover context_lens[i]
    # None, or per sequence None (causal) or its query tokens' tree parents (see the module's
    # docstring): parents[j] in [-1, j).
    tree_parents: list[list[int] | None] | None = None

    def tree_of(self, seq_index: int) -> list[int] | None:
        """Sequence `seq_index`'s tree parents; None for a causal segment."""
        return None if self.tree_parents is None else self.tree_parents[seq_index]

    def tree_parent_tensors(self) -> list[torch.Tensor]:
        """The kernels' form of `tree_parents`: [] when no sequence is a tree, else one int64
        tensor per sequence, empty for a causal one."""
        if self.tree_parents is None or all(parents is None for parents in self.tree_parents):
            return []
        empty = torch.empty(0, dtype=torch.long)
        return [empty if parents is None else torch.tensor(parents, dtype=torch.long)
                for parents in self.tree_parents]


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache, then attends every query token."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
