"""`KVCache`: the paged key/value pool of one model.

Terms:
- *block*: `block_size` consecutive token positions of one sequence; the unit the block
  manager hands out.
- *slot*: one token position in the pool, `block_id * block_size + offset`. Attention writes
  the K/V of each input token at its slot (`AttentionMetadata.slot_mapping`).

Each layer owns two tensors (keys, values) of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`; block `b` of every layer belongs to the
same sequence, so one block table serves all layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCache:
    """Per-layer key and value pools; see the module docstring."""

    key_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.key_caches[0].shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.key_caches)

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, keys and values: sizes the pool from a budget."""
        element_size = torch.empty((), dtype=dtype).element_size()
        per_layer = block_size * model_config.num_key_value_heads * model_config.head_dim * element_size
        return 2 * model_config.num_hidden_layers * per_layer

    @classmethod
    def allocate(
        cls,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """Allocate an uninitialised pool; slots are always written before they are read."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        shape = (num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
        key_caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(model_config.num_hidden_layers)]
        value_caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(model_config.num_hidden_layers)]
        total = cls.bytes_per_block(model_config, block_size, dtype) * num_blocks
        logger.info(
            "KV cache: %d blocks x %d tokens, %s on %s, %.1f MiB",
            num_blocks, block_size, dtype, device, total / 2**20,
        )
        return cls(key_caches=key_caches, value_caches=value_caches, block_size=block_size)

    def move_slots(self, source_slots: torch.Tensor, target_slots: torch.Tensor) -> None:
        """Copies the K/V at each source slot to its target slot, in every layer (all the
        sources read before any target is written)."""
        for cache in (*self.key_caches, *self.value_caches):
            rows = cache.view(-1, cache.shape[2], cache.shape[3])
            rows.index_copy_(0, target_slots, rows.index_select(0, source_slots))
