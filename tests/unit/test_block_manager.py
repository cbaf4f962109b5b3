"""Block manager: allocation, rollback, freeing, no leaks."""

from __future__ import annotations

import pytest

from specdec.engine.block_manager import BlockManager
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence


def make_seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(range(num_tokens)),
                    prompt_len=num_tokens, params=SamplingParams(max_tokens=8),
                    max_speculative_tokens=0)


@pytest.mark.parametrize("num_tokens,expected_blocks", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocate_covers_slots(num_tokens: int, expected_blocks: int) -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(0, num_tokens)
    manager.allocate(seq, num_tokens)
    assert len(seq.block_table) == expected_blocks
    assert manager.num_free_blocks == 10 - expected_blocks
    assert len(set(seq.block_table)) == expected_blocks


def test_allocate_only_grows_and_slots_are_distinct() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first, second = make_seq(0, 6), make_seq(1, 6)
    manager.allocate(first, 6)
    manager.allocate(second, 6)
    manager.allocate(first, 10)
    table_before = list(first.block_table)
    manager.allocate(first, 3)  # asking for fewer never shrinks
    assert first.block_table == table_before
    slots = {manager.slot(seq, position) for seq, n in ((first, 10), (second, 6))
             for position in range(n)}
    assert len(slots) == 16


def test_trim_rolls_back_rejected_draft_slots() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, 7)
    manager.allocate(seq, 7 + 5)  # 1 token + 4 drafts reserved past 7 -> 12 slots, 3 blocks
    assert len(seq.block_table) == 3
    manager.trim(seq, 8)  # two accepted: 8 tokens kept
    assert len(seq.block_table) == 2
    assert manager.num_free_blocks == 6


def test_can_allocate_and_refusal() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(0, 4)
    assert manager.can_allocate(seq, 8)
    assert not manager.can_allocate(seq, 9)
    with pytest.raises(RuntimeError):
        manager.allocate(seq, 9)
    assert manager.num_free_blocks == 2


def test_free_returns_everything() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    seqs = [make_seq(i, 3 + 5 * i) for i in range(3)]
    for seq in seqs:
        manager.allocate(seq, seq.num_tokens)
    for seq in seqs:
        manager.free(seq)
        assert seq.block_table == []
    assert manager.num_free_blocks == 16
    assert manager.usage == 0.0
