"""Accounting of the paged KV cache's blocks; owns no tensors.

Each sequence has a block table: the ids of the blocks holding its tokens' K/V, in
order; token t lives in block `block_table[t // block_size]` at offset
`t % block_size`. Check/act pairs: `can_allocate` before `allocate`.
"""

from __future__ import annotations

from collections import deque

from specdec.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its table covers `num_tokens` slots."""
        return max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grows `seq`'s block table to cover `num_tokens` slots."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"allocate: need {missing} blocks, {self.num_free_blocks} free")
        for _ in range(missing):
            seq.block_table.append(self._free_block_ids.popleft())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Returns the blocks past the first `num_tokens` slots to the pool (rollback)."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._free_block_ids.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self._free_block_ids.extend(reversed(seq.block_table))
        seq.block_table.clear()

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
