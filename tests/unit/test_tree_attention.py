"""Tree attention: a tree segment's token attends to the cached prefix and its own path.

A tree-drafted sequence's verify window holds several branches; each of its tokens must get
what a decode of its path would get. Checked three ways on random batches that mix a tree
with plain decode, verify and prefill segments: the reference's tree mask against an
explicit decode of each path (the path's K/V at contiguous positions), the C++ kernel
against the reference, and the kernel's tree rows bit for bit against its own decode of
each path (its batch invariance carried over to trees).
"""

from __future__ import annotations

import pytest
import torch

from specdec.layers.attention import AttentionMetadata, TorchPagedAttention, write_kv
from specdec.layers.attention_cpu import CpuPagedAttention
from specdec.layers.attention_torch import tree_attention_mask
from tests.support.cpu_kernels import extension_or_skip

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# Root (the last verified token), then two branches of depth 3 and 2 and a lone child: the
# nodes in the order a proposer sends them (parents first).
TREE_PARENTS = [-1, 0, 1, 2, 0, 4, 1, 0]
DTYPE_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _step(cached_lens: list[int], query_lens: list[int], trees: list[list[int] | None], dtype: torch.dtype,
          seed: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A step's inputs and caches holding each sequence's cached prefix (random K/V)."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // BLOCK_SIZE) + 1 for c, q in zip(cached_lens, query_lens)) + 8
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables, slots, starts = [], [], [0]
    for cached_len, query_len in zip(cached_lens, query_lens):
        context_len = cached_len + query_len
        blocks = [free_blocks.pop() for _ in range(-(-context_len // BLOCK_SIZE))]
        block_tables.append(torch.tensor(blocks))
        seq_slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context_len)]
        if cached_len:
            prefix = torch.randn(2, cached_len, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
            write_kv(prefix[0], prefix[1], key_cache, value_cache, torch.tensor(seq_slots[:cached_len]))
        slots += seq_slots[cached_len:]
        starts.append(starts[-1] + query_len)
    num_tokens = starts[-1]
    inputs = dict(
        query=torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype),
        key=torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype),
        value=torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype),
        metadata=AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_locs=starts,
                                   context_lens=[c + q for c, q in zip(cached_lens, query_lens)],
                                   block_tables=block_tables, tree_parents=trees),
    )
    return inputs, key_cache, value_cache


def _path(parents: list[int], token: int) -> list[int]:
    path = []
    while token >= 0:
        path.append(token)
        token = parents[token]
    return path[::-1]


def _decode_paths(backend: CpuPagedAttention | TorchPagedAttention, inputs: dict, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, seq_index: int, parents: list[int]) -> torch.Tensor:
    """Each tree token's attention computed as a decode: a copy of the sequence's cached
    prefix followed by its path's K/V at contiguous positions, its own query last."""
    metadata: AttentionMetadata = inputs["metadata"]
    start = metadata.query_start_locs[seq_index]
    cached_len = metadata.context_lens[seq_index] - len(parents)
    table = metadata.block_tables[seq_index]
    prefix_slots = torch.tensor([int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                                 for p in range(cached_len)], dtype=torch.long)
    rows = []
    for token in range(len(parents)):
        path = [start + node for node in _path(parents, token)]
        context_len = cached_len + len(path)
        num_blocks = -(-context_len // BLOCK_SIZE)
        keys = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=key_cache.dtype)
        values = torch.zeros_like(keys)
        flat_keys, flat_values = keys.view(-1, NUM_KV_HEADS, HEAD_DIM), values.view(-1, NUM_KV_HEADS, HEAD_DIM)
        flat_keys[:cached_len] = key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[prefix_slots]
        flat_values[:cached_len] = value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[prefix_slots]
        flat_keys[cached_len:context_len - 1] = inputs["key"][path[:-1]]
        flat_values[cached_len:context_len - 1] = inputs["value"][path[:-1]]
        decode = AttentionMetadata(slot_mapping=torch.tensor([context_len - 1]), query_start_locs=[0, 1],
                                   context_lens=[context_len], block_tables=[torch.arange(num_blocks)])
        row = start + token
        rows.append(backend.forward(inputs["query"][row:row + 1], inputs["key"][row:row + 1],
                                    inputs["value"][row:row + 1], keys, values, decode))
    return torch.cat(rows)


# (cached lengths, query lengths, which sequence is the tree); a tree beside a decode, a
# verify window and a prefill, with contexts that cross the kernel's 128-position chunks.
BATCHES = [
    ([40], [len(TREE_PARENTS)], 0),
    ([300, 37, 64, 0], [len(TREE_PARENTS), 1, 4, 12], 0),
    ([5, 125], [3, len(TREE_PARENTS)], 1),
]


def _trees(num_seqs: int, tree_index: int) -> list[list[int] | None]:
    return [TREE_PARENTS if index == tree_index else None for index in range(num_seqs)]


def test_tree_mask_is_prefix_plus_path() -> None:
    mask = tree_attention_mask([-1, 0, 0, 2], context_len=6, device=torch.device("cpu"))
    assert mask.tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, False, True, False],
        [True, True, True, False, True, True],
    ]
    with pytest.raises(ValueError, match="does not come before"):
        tree_attention_mask([-1, 1], context_len=2, device=torch.device("cpu"))


@pytest.mark.parametrize("cached_lens,query_lens,tree_index", BATCHES)
def test_reference_tree_rows_equal_path_decodes(cached_lens: list[int], query_lens: list[int],
                                                tree_index: int) -> None:
    inputs, key_cache, value_cache = _step(cached_lens, query_lens, _trees(len(cached_lens), tree_index),
                                           torch.float32, seed=len(cached_lens))
    reference = TorchPagedAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    out = reference.forward(inputs["query"], inputs["key"], inputs["value"], key_cache, value_cache,
                            inputs["metadata"])
    start = inputs["metadata"].query_start_locs[tree_index]
    expected = _decode_paths(reference, inputs, key_cache, value_cache, tree_index, TREE_PARENTS)
    torch.testing.assert_close(out[start:start + len(TREE_PARENTS)], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", list(DTYPE_TOLERANCE), ids=str)
@pytest.mark.parametrize("cached_lens,query_lens,tree_index", BATCHES)
def test_kernel_tree_matches_reference(dtype: torch.dtype, cached_lens: list[int], query_lens: list[int],
                                       tree_index: int) -> None:
    kernel = extension_or_skip()
    inputs, key_cache, value_cache = _step(cached_lens, query_lens, _trees(len(cached_lens), tree_index),
                                           dtype, seed=7 * len(cached_lens))
    reference_caches = (key_cache.clone(), value_cache.clone())
    out = CpuPagedAttention(kernel, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM).forward(
        inputs["query"], inputs["key"], inputs["value"], key_cache, value_cache, inputs["metadata"])
    expected = TorchPagedAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM).forward(
        inputs["query"], inputs["key"], inputs["value"], *reference_caches, inputs["metadata"])
    tolerance = DTYPE_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(key_cache, reference_caches[0]) and torch.equal(value_cache, reference_caches[1])


@pytest.mark.parametrize("dtype", list(DTYPE_TOLERANCE), ids=str)
@pytest.mark.parametrize("cached_lens,query_lens,tree_index", BATCHES)
def test_kernel_tree_rows_are_bitwise_path_decodes(dtype: torch.dtype, cached_lens: list[int],
                                                   query_lens: list[int], tree_index: int) -> None:
    kernel = extension_or_skip()
    inputs, key_cache, value_cache = _step(cached_lens, query_lens, _trees(len(cached_lens), tree_index),
                                           dtype, seed=11 * len(cached_lens))
    backend = CpuPagedAttention(kernel, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    prefix_caches = (key_cache.clone(), value_cache.clone())
    out = backend.forward(inputs["query"], inputs["key"], inputs["value"], key_cache, value_cache,
                          inputs["metadata"])
    start = inputs["metadata"].query_start_locs[tree_index]
    expected = _decode_paths(backend, inputs, *prefix_caches, tree_index, TREE_PARENTS)
    assert torch.equal(out[start:start + len(TREE_PARENTS)], expected)


def test_kernel_refuses_a_parent_after_its_child() -> None:
    kernel = extension_or_skip()
    inputs, key_cache, value_cache = _step([10], [3], [[-1, 2, 0]], torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="does not come before"):
        CpuPagedAttention(kernel, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM).forward(
            inputs["query"], inputs["key"], inputs["value"], key_cache, value_cache, inputs["metadata"])
