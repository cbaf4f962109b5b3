"""`CpuPagedAttention`: the CPU's paged attention, one C++ call per layer.

The kernel (`specdec/layers/csrc/paged_attention_cpu.cpp`) writes the step's K/V into the paged
cache and attends every query token in one call: a decode token or a verify window reads its
cached rows straight from the blocks in fp32 arithmetic, and so does a prefill chunk, piece
by piece, each row reduced over its keys as a decode of it would be (batch invariance; with
`VLLM_BATCH_INVARIANT=0` a prefill chunk goes through torch's SDPA as `TorchPagedAttention`
does). It replaces about twenty dispatcher trips a layer (the
reference's gather, conversions and SDPA per sequence), which cost more than the arithmetic
of a decode step on a small model.

It is built once per machine with specdec's other CPU kernels (`specdec.layers.cpu_extension`).
Where it cannot be built (no compiler, as in the slim container image) the caller keeps the
reference backend.
"""

from __future__ import annotations

from types import ModuleType

import torch

from specdec.layers.attention_metadata import AttentionMetadata
from specdec.layers.batch_invariance import batch_invariant_requested


class CpuPagedAttention:
    """Paged attention on the CPU through the C++ kernel; same contract and results (to
    rounding) as `TorchPagedAttention`, which it is tested against."""

    def __init__(self, kernel: ModuleType, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None) -> None:
        self.kernel = kernel
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.batch_invariant = batch_invariant_requested()

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], contiguous
        return self.kernel.paged_attention(query, key, value, key_cache, value_cache, metadata.slot_mapping,
                                           metadata.query_start_locs, metadata.context_lens,
                                           metadata.block_tables, self.scale, self.batch_invariant,
                                           metadata.tree_parent_tensors())
