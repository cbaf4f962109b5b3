"""The C++ CPU paged attention against the plain-torch reference on random batches.

Each batch mixes what a step holds: prefill chunks (first and later ones, short and past the
kernel's SDPA threshold), decode tokens and verify windows, over shuffled blocks, in fp32,
bf16 and fp16, with the query/key/value given as views of one fused projection (as the
model passes them). Skipped where the kernel cannot be built; CI, which has a compiler, sets
SPECDEC_REQUIRE_CPU_KERNELS=1 and fails instead (tests/cpu_kernels.py).
"""

from __future__ import annotations

import logging

import pytest
import torch

from specdec.layers import cpu_extension
from specdec.layers.attention import (
    ATTENTION_BACKEND_ENV,
    AttentionMetadata,
    TorchPagedAttention,
    write_kv,
)
from specdec.layers.attention_cpu import CpuPagedAttention
from specdec.layers.cpu_extension import load_extension
from tests.cpu_kernels import extension_or_skip

# (num_heads, num_kv_heads, head_dim, block_size, per sequence (cached_len, query_len))
CASES = [
    (9, 3, 64, 16, [(200, 1)]),  # the default model's decode step
    (9, 3, 64, 16, [(200, 5), (37, 1), (0, 12), (64, 4)]),  # verify, decode, prefill, verify
    (4, 4, 8, 4, [(0, 40), (23, 35), (5, 33)]),  # long segments: SDPA, with and without a cache
    (6, 2, 16, 8, [(17, 1), (0, 1), (8, 8), (3, 32)]),  # at the kernel's length limit
    (2, 1, 32, 16, [(0, 3), (15, 1), (16, 1)]),  # block boundaries
    (9, 3, 64, 16, [(600, 5), (254, 3), (255, 1), (512, 1)]),  # contexts split into chunks across threads
]
DTYPES = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def build_batch(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                seq_shapes: list[tuple[int, int]], dtype: torch.dtype, table_dtype: torch.dtype,
                seed: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The step's inputs (query/key/value as strided views of one fused tensor), and two equal
    caches already holding every sequence's cached prefix."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // block_size) + 1 for c, q in seq_shapes) + 4
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables, slot_mapping, starts = [], [], [0]
    for cached_len, query_len in seq_shapes:
        context_len = cached_len + query_len
        blocks = [free_blocks.pop() for _ in range(-(-context_len // block_size) + 1)]
        block_tables.append(torch.tensor(blocks, dtype=table_dtype))
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(context_len)]
        if cached_len:
            prefix = torch.randn(2, cached_len, num_kv_heads, head_dim, generator=generator).to(dtype)
            write_kv(prefix[0], prefix[1], key_cache, value_cache, torch.tensor(slots[:cached_len]))
        slot_mapping += slots[cached_len:]
        starts.append(starts[-1] + query_len)
    fused = torch.randn(starts[-1], (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    query, key, value = fused.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    inputs = dict(
        query=query.view(-1, num_heads, head_dim), key=key.view(-1, num_kv_heads, head_dim),
        value=value.view(-1, num_kv_heads, head_dim),
        metadata=AttentionMetadata(slot_mapping=torch.tensor(slot_mapping), query_start_locs=starts,
                                   context_lens=[c + q for c, q in seq_shapes], block_tables=block_tables),
    )
    return inputs, key_cache, value_cache


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_shapes", CASES)
def test_kernel_matches_reference(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                                  block_size: int, seq_shapes: list[tuple[int, int]]) -> None:
    kernel = extension_or_skip()
    table_dtype = torch.int32 if len(seq_shapes) % 2 else torch.int64
    inputs, key_cache, value_cache = build_batch(num_heads, num_kv_heads, head_dim, block_size, seq_shapes,
                                                 dtype, table_dtype, seed=num_heads * 31 + len(seq_shapes))
    assert inputs["query"].shape[0] == 1 or not inputs["query"].is_contiguous()  # views of the fused rows
    reference_caches = key_cache.clone(), value_cache.clone()
    reference = TorchPagedAttention(num_heads, num_kv_heads, head_dim).forward(
        inputs["query"], inputs["key"], inputs["value"], *reference_caches, inputs["metadata"])
    backend = CpuPagedAttention(kernel, num_heads, num_kv_heads, head_dim)
    output = backend.forward(inputs["query"], inputs["key"], inputs["value"], key_cache, value_cache,
                             inputs["metadata"])
    assert output.dtype == dtype and output.is_contiguous()
    tolerance = DTYPES[dtype]
    torch.testing.assert_close(output, reference, atol=tolerance, rtol=tolerance)
    # The step's K/V are written exactly where the reference writes them, and nowhere else.
    assert torch.equal(key_cache, reference_caches[0]) and torch.equal(value_cache, reference_caches[1])


def test_fp32_is_close_to_exact_on_a_long_decode() -> None:
    """fp32 agreement tight enough for greedy invariance: a 1,000-token context."""
    kernel = extension_or_skip()
    inputs, key_cache, value_cache = build_batch(9, 3, 64, 16, [(1000, 1), (1000, 5)], torch.float32,
                                                 torch.int64, seed=5)
    reference = TorchPagedAttention(9, 3, 64).forward(inputs["query"], inputs["key"], inputs["value"],
                                                     key_cache.clone(), value_cache.clone(), inputs["metadata"])
    output = CpuPagedAttention(kernel, 9, 3, 64).forward(inputs["query"], inputs["key"], inputs["value"],
                                                        key_cache, value_cache, inputs["metadata"])
    assert (output - reference).abs().max().item() < 1e-5


# (num_heads, num_kv_heads, head_dim): the default model's, then other query heads per KV
# head and head sizes, so that a window's rows go in blocks of every size the kernel uses
# (1 to 6 rows for head_dim 64, 1 to 4 for the others; 96 and 40 take the any-size path, 40
# with a tail past its whole vectors).
INVARIANCE_SHAPES = [(9, 3, 64), (8, 2, 64), (4, 4, 64), (10, 2, 64), (8, 2, 128), (12, 4, 96), (4, 2, 40)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", INVARIANCE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_verify_window_attends_as_one_token_decodes_would(dtype: torch.dtype, num_heads: int,
                                                            num_kv_heads: int, head_dim: int) -> None:
    """Row invariance over a long context: each token of a verify window whose context crosses
    the kernel's chunk boundaries gets bit for bit what decoding it alone would, which is
    what keeps greedy speculation identical to plain decoding. The kernel takes a window's
    rows (tokens x query heads per KV head) in blocks whose size depends on the window's
    length, so this also holds each row to the same bits in every block size."""
    kernel = extension_or_skip()
    backend = CpuPagedAttention(kernel, num_heads, num_kv_heads, head_dim)
    cached_len, window = 509, 6  # the window's contexts end on both sides of position 512
    inputs, key_cache, value_cache = build_batch(num_heads, num_kv_heads, head_dim, 16, [(cached_len, window)],
                                                 dtype, torch.int64, seed=11)
    metadata = inputs["metadata"]
    together = backend.forward(inputs["query"], inputs["key"], inputs["value"], key_cache.clone(),
                               value_cache.clone(), metadata)
    for j in range(window):
        # The window cut after token j, and token j decoded alone with the earlier ones cached.
        prefix = AttentionMetadata(slot_mapping=metadata.slot_mapping[: j + 1], query_start_locs=[0, j + 1],
                                   context_lens=[cached_len + j + 1], block_tables=metadata.block_tables)
        shorter = backend.forward(inputs["query"][: j + 1], inputs["key"][: j + 1], inputs["value"][: j + 1],
                                  key_cache.clone(), value_cache.clone(), prefix)
        assert torch.equal(shorter[j], together[j]), f"token {j} differs in a shorter window"
        cache = key_cache.clone(), value_cache.clone()
        write_kv(inputs["key"][:j], inputs["value"][:j], *cache, metadata.slot_mapping[:j])
        decode = AttentionMetadata(slot_mapping=metadata.slot_mapping[j : j + 1], query_start_locs=[0, 1],
                                   context_lens=[cached_len + j + 1], block_tables=metadata.block_tables)
        decoded = backend.forward(inputs["query"][j : j + 1], inputs["key"][j : j + 1],
                                  inputs["value"][j : j + 1], *cache, decode)
        assert torch.equal(decoded[0], together[j]), f"token {j} differs decoded alone"


def test_bad_slots_and_short_tables_raise_instead_of_writing_out_of_bounds() -> None:
    kernel = extension_or_skip()
    inputs, key_cache, value_cache = build_batch(2, 1, 8, 4, [(3, 1)], torch.float32, torch.int64, seed=1)
    backend = CpuPagedAttention(kernel, 2, 1, 8)
    metadata = inputs["metadata"]
    bad_slot = AttentionMetadata(slot_mapping=torch.tensor([key_cache.shape[0] * 4]),
                                 query_start_locs=metadata.query_start_locs, context_lens=metadata.context_lens,
                                 block_tables=metadata.block_tables)
    with pytest.raises(RuntimeError, match="outside the cache"):
        backend.forward(inputs["query"], inputs["key"], inputs["value"], key_cache, value_cache, bad_slot)
    short_table = AttentionMetadata(slot_mapping=metadata.slot_mapping, query_start_locs=metadata.query_start_locs,
                                    context_lens=[9], block_tables=[metadata.block_tables[0][:1]])
    with pytest.raises(RuntimeError, match="block table covers fewer"):
        backend.forward(inputs["query"], inputs["key"], inputs["value"], key_cache, value_cache, short_table)


def test_a_failed_build_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    from specdec.layers.attention import make_attention_backend

    def no_compiler(**kwargs: object) -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    load_extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
            backend = make_attention_backend(torch.device("cpu"), 4, 2, 8)
        assert isinstance(backend, TorchPagedAttention)
        assert "Ninja is required" in caplog.text
    finally:
        load_extension.cache_clear()
