"""The reference paged attention against a dense causal attention on random tensors."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.layers.attention import AttentionMetadata, TorchPagedAttention, write_kv


def dense_causal_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Softmax attention written out: query j sits at position context_len - query_len + j."""
    query_len, num_heads, head_dim = query.shape
    context_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for head in range(num_heads):
        kv_head = head // group
        scores = query[:, head] @ key[:, kv_head].T / math.sqrt(head_dim)  # [query_len, context_len]
        for j in range(query_len):
            scores[j, context_len - query_len + j + 1:] = float("-inf")
        out[:, head] = scores.softmax(-1) @ value[:, kv_head]
    return out


# (num_heads, num_kv_heads, per sequence (cached_len, query_len))
CASES = [
    (4, 4, [(0, 7)]),  # MHA, one prefill
    (4, 2, [(0, 9), (5, 1), (12, 4), (3, 3)]),  # GQA: prefill, decode, verify window, chunk
    (6, 2, [(17, 1), (0, 1), (8, 8)]),  # all lengths crossing block boundaries
    (2, 1, [(30, 1)]),  # one decode token: the no-mask path
]


@pytest.mark.parametrize("num_heads,num_kv_heads,seq_shapes", CASES)
def test_paged_matches_dense(device: torch.device, num_heads: int, num_kv_heads: int,
                             seq_shapes: list[tuple[int, int]]) -> None:
    generator = torch.Generator().manual_seed(len(seq_shapes) * 7 + num_heads)
    head_dim, block_size, num_blocks = 8, 4, 64
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    value_cache = torch.zeros_like(key_cache)
    # Non-contiguous block tables: a random permutation of the pool split among sequences,
    # each given two spare blocks beyond what it needs.
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    full_keys, full_values, queries, block_tables = [], [], [], []
    for cached_len, query_len in seq_shapes:
        context_len = cached_len + query_len
        blocks = [free_blocks.pop() for _ in range(-(-context_len // block_size) + 2)]
        block_tables.append(torch.tensor(blocks, dtype=torch.int64, device=device))
        full_keys.append(torch.randn(context_len, num_kv_heads, head_dim, generator=generator).to(device))
        full_values.append(torch.randn(context_len, num_kv_heads, head_dim, generator=generator).to(device))
        queries.append(torch.randn(query_len, num_heads, head_dim, generator=generator).to(device))

    def slots(seq: int, begin: int, end: int) -> list[int]:
        return [int(block_tables[seq][p // block_size]) * block_size + p % block_size for p in range(begin, end)]

    # Earlier steps wrote the cached prefix of every sequence.
    for seq, (cached_len, _) in enumerate(seq_shapes):
        if cached_len:
            write_kv(full_keys[seq][:cached_len], full_values[seq][:cached_len], key_cache, value_cache,
                     torch.tensor(slots(seq, 0, cached_len), device=device))

    starts = [0]
    slot_mapping: list[int] = []
    for seq, (cached_len, query_len) in enumerate(seq_shapes):
        starts.append(starts[-1] + query_len)
        slot_mapping += slots(seq, cached_len, cached_len + query_len)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_locs=starts,
        context_lens=[c + q for c, q in seq_shapes],
        block_tables=block_tables,
    )
    key = torch.cat([k[c:] for k, (c, _) in zip(full_keys, seq_shapes)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_values, seq_shapes)])
    backend = TorchPagedAttention(num_heads, num_kv_heads, head_dim)
    output = backend.forward(torch.cat(queries), key, value, key_cache, value_cache, metadata)

    assert output.shape == (starts[-1], num_heads, head_dim)
    for seq in range(len(seq_shapes)):
        expected = dense_causal_attention(queries[seq].cpu(), full_keys[seq].cpu(), full_values[seq].cpu())
        torch.testing.assert_close(output[starts[seq]:starts[seq + 1]].cpu(), expected, atol=1e-5, rtol=1e-5)
        # This step's K/V landed at their slots.
        cached_len, query_len = seq_shapes[seq]
        flat_keys = key_cache.view(-1, num_kv_heads, head_dim)
        written = flat_keys[torch.tensor(slots(seq, cached_len, cached_len + query_len), device=device)]
        torch.testing.assert_close(written.cpu(), full_keys[seq][cached_len:].cpu())


def test_mask_cache_grows_and_is_reused(device: torch.device) -> None:
    backend = TorchPagedAttention(2, 1, 4)
    first = backend._mask_rows(3, 10, device)
    assert first.shape == (7, 10)
    assert first[0].tolist() == [True] * 4 + [False] * 6  # position 3 sees 0..3
    cached = backend._causal_mask
    backend._mask_rows(0, 200, device)
    assert backend._causal_mask is cached  # no reallocation below the cached size
    big = backend._mask_rows(500, 600, device)
    assert big.shape == (100, 600) and bool(big[-1].all())
