"""The C++ CPU paged attention against the plain-torch reference on random batches.

Each batch mixes what a step holds: prefill chunks (first and later ones, short and past the
kernel's SDPA threshold), decode tokens and verify windows, over shuffled blocks, in fp32,
bf16 and fp16, with the query/key/value given as views of one fused projection (as the
model passes them). Skipped where the kernel cannot be built; CI, which has a compiler, sets
SPECDEC_REQUIRE_CPU_KERNELS=1 and fails instead (tests/support/cpu_kernels.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

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
from tests.support.cpu_kernels import extension_or_skip

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


def _attend_in_steps(backend: CpuPagedAttention, inputs: dict, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     cuts: list[int], others: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """The one sequence of `inputs` (an empty cache, all its tokens as queries) attended in
    steps ending at `cuts` (a prefill chunk, a cache-hit tail, decodes), each step sharing
    its call with sequences of the shapes `others` (cached_len, query_len); its rows' outputs."""
    metadata = inputs["metadata"]
    outputs, start = [], 0
    for end in cuts:
        extra, extra_keys, extra_values = build_batch(backend.num_heads, backend.num_kv_heads, backend.head_dim,
                                                      16, others, dtype, torch.int64, seed=end)
        extra_metadata = extra["metadata"]
        # Both sequences in one call: the other sequences' blocks lie past this sequence's.
        offset = key_cache.shape[0]
        keys, values = torch.cat((key_cache, extra_keys)), torch.cat((value_cache, extra_values))
        step = AttentionMetadata(
            slot_mapping=torch.cat((extra_metadata.slot_mapping + offset * 16, metadata.slot_mapping[start:end])),
            query_start_locs=[*extra_metadata.query_start_locs, extra_metadata.query_start_locs[-1] + end - start],
            context_lens=[*extra_metadata.context_lens, end],
            block_tables=[*(table.long() + offset for table in extra_metadata.block_tables), metadata.block_tables[0]])
        attended = backend.forward(torch.cat((extra["query"], inputs["query"][start:end])),
                                   torch.cat((extra["key"], inputs["key"][start:end])),
                                   torch.cat((extra["value"], inputs["value"][start:end])), keys, values, step)
        key_cache.copy_(keys[:offset])
        value_cache.copy_(values[:offset])
        outputs.append(attended[extra_metadata.query_start_locs[-1]:])
        start = end
    return torch.cat(outputs)


# How a 300-token prompt reaches the cache: one prefill, prefill chunks of the sizes a
# --max-num-batched-tokens gives, a cache hit then its tail, a short prefill then decodes.
PROMPT_LEN = 300
SPLITS = {
    "chunks of 16": list(range(16, PROMPT_LEN, 16)) + [PROMPT_LEN],
    "chunks of 100": [100, 200, PROMPT_LEN],
    "cache hit, tail of 44": [256, PROMPT_LEN],
    "prefill then decodes": [290, *range(291, PROMPT_LEN + 1)],
}
# Other sequences in the call: none, a decode, a verify window and a prefill, many decodes.
OTHERS = {"alone": [], "1 decode": [(40, 1)], "window and prefill": [(130, 7), (0, 64)],
          "64 decodes": [(20 + 3 * i, 1) for i in range(64)]}


# Each split beside one kind of other sequences (the 64 decodes with the two-step split: each
# step builds their batch anew).
SPLIT_CASES = [("chunks of 16", "window and prefill"), ("chunks of 100", "1 decode"),
               ("cache hit, tail of 44", "64 decodes"), ("prefill then decodes", "alone")]


@pytest.mark.parametrize("split,others", SPLIT_CASES, ids=[f"{split}, {others}" for split, others in SPLIT_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_a_prefill_attends_as_decodes_would_whatever_the_chunking(dtype: torch.dtype, split: str,
                                                                  others: str) -> None:
    """Batch invariance of a prefill: each prompt token's attention has the same bits whether
    its prefix was computed in the same call (a 300-token prefill, past the kernel's 32-token
    pieces) or read from the cache (a chunk, a cache-hit tail, a decode), and whatever other
    sequences share the call."""
    kernel = extension_or_skip()
    backend = CpuPagedAttention(kernel, 9, 3, 64)
    assert backend.batch_invariant
    inputs, key_cache, value_cache = build_batch(9, 3, 64, 16, [(0, PROMPT_LEN)], dtype, torch.int64, seed=7)
    whole = _attend_in_steps(backend, inputs, key_cache.clone(), value_cache.clone(), [PROMPT_LEN], [], dtype)
    reference = TorchPagedAttention(9, 3, 64).forward(inputs["query"], inputs["key"], inputs["value"],
                                                     key_cache.clone(), value_cache.clone(), inputs["metadata"])
    torch.testing.assert_close(whole, reference, atol=DTYPES[dtype], rtol=DTYPES[dtype])
    stepped = _attend_in_steps(backend, inputs, key_cache.clone(), value_cache.clone(), SPLITS[split],
                               OTHERS[others], dtype)
    differing = (stepped != whole).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert not differing, f"tokens {differing[:10]} ({len(differing)} in all) differ"


def test_without_batch_invariance_a_long_prefill_goes_by_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_BATCH_INVARIANT=0: a long segment is torch's SDPA, whose bits depend on the
    segment's length: the prompt's last tokens then differ between a prefill and decodes."""
    kernel = extension_or_skip()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    backend = CpuPagedAttention(kernel, 9, 3, 64)
    assert not backend.batch_invariant
    inputs, key_cache, value_cache = build_batch(9, 3, 64, 16, [(0, PROMPT_LEN)], torch.bfloat16, torch.int64,
                                                 seed=7)
    whole = _attend_in_steps(backend, inputs, key_cache.clone(), value_cache.clone(), [PROMPT_LEN], [],
                             torch.bfloat16)
    stepped = _attend_in_steps(backend, inputs, key_cache.clone(), value_cache.clone(),
                               SPLITS["prefill then decodes"], [], torch.bfloat16)
    assert not torch.equal(stepped, whole)


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
                                                    caplog: pytest.LogCaptureFixture,
                                                    tmp_path: Path) -> None:
    from specdec.layers.attention import make_attention_backend

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    # An empty kernel cache (this machine's holds a build) and a compiler that fails.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_extension, "_compile", no_compiler)
    load_extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
            backend = make_attention_backend(torch.device("cpu"), 4, 2, 8)
        assert isinstance(backend, TorchPagedAttention)
        assert "Ninja is required" in caplog.text
    finally:
        load_extension.cache_clear()
