"""The NPU attention backend against the plain-torch reference, with a fake torch_npu.

No NPU is available here. A stand-in `torch_npu` module, injected into `sys.modules`,
implements `npu_fused_infer_attention_score` (TND layout, paged K/V through a block table,
sparse_mode 3) and `npu_scatter_nd_update_` in plain torch as torch_npu documents them, and
checks every argument the backend passes: the layout, the int32 block table, cumulative
query lengths, per-sequence KV lengths, head counts, scale, block size and the compressed
causal mask. So the marshalling is exercised and its result compared with
`TorchPagedAttention`; the kernel itself is not.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest
import torch

from specdec.errors import ConfigError
from specdec.layers.attention import (
    ATTENTION_BACKEND_ENV,
    AttentionMetadata,
    TorchPagedAttention,
    make_attention_backend,
)
from specdec.layers.attention_cpu import CpuPagedAttention
from specdec.layers.attention_npu import NpuFusedPagedAttention

BLOCK_SIZE = 16
NUM_BLOCKS = 48
HEAD_DIM = 16


class FakeTorchNpu(types.ModuleType):
    """torch_npu's two ops in plain torch, per their documentation; records each call."""

    def __init__(self, fail_attention: bool = False) -> None:
        super().__init__("torch_npu")
        self.fail_attention = fail_attention
        self.attention_calls: list[dict[str, Any]] = []
        self.scatter_calls = 0

    def npu_scatter_nd_update_(self, target: torch.Tensor, indices: torch.Tensor,
                               updates: torch.Tensor) -> torch.Tensor:
        # Documented: indices [n, a] address the first a dims of target; updates have
        # shape indices.shape[:-1] + target.shape[a:] and target's dtype.
        assert indices.dim() == 2 and indices.shape[1] == 1
        assert updates.shape == (indices.shape[0], *target.shape[1:])
        assert updates.dtype == target.dtype
        self.scatter_calls += 1
        target[indices[:, 0]] = updates
        return target

    def npu_fused_infer_attention_score(self, query: torch.Tensor, key: torch.Tensor,
                                        value: torch.Tensor, **kwargs: Any,
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
        self.attention_calls.append(kwargs)
        if self.fail_attention:
            raise RuntimeError("EZ1001: unsupported shape (fake)")
        assert kwargs["input_layout"] == "TND"
        assert kwargs["sparse_mode"] == 3
        assert query.dtype in (torch.float16, torch.bfloat16) and query.is_contiguous()
        num_tokens, num_heads, head_dim = query.shape
        assert kwargs["num_heads"] == num_heads
        num_kv_heads = kwargs["num_key_value_heads"]
        assert num_heads % num_kv_heads == 0
        block_size = kwargs["block_size"]
        assert block_size % 16 == 0
        # Paged K/V: [num_blocks, block_size, num_kv_heads * head_dim].
        assert key.dim() == 3 and key.shape[1] == block_size
        assert key.shape[2] == num_kv_heads * head_dim and value.shape == key.shape
        block_table = kwargs["block_table"]
        assert block_table.dtype == torch.int32 and block_table.dim() == 2
        mask = kwargs["atten_mask"]
        assert mask.shape == (2048, 2048) and mask.dtype == torch.bool
        assert torch.equal(mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
        query_ends = kwargs["actual_seq_lengths"]
        kv_lens = kwargs["actual_seq_lengths_kv"]
        assert isinstance(query_ends, list) and isinstance(kv_lens, list)
        assert len(query_ends) == len(kv_lens) == block_table.shape[0]
        assert query_ends == sorted(query_ends) and query_ends[-1] == num_tokens
        scale = kwargs["scale"]
        group = num_heads // num_kv_heads
        output = torch.empty_like(query)
        start = 0
        for seq, (end, kv_len) in enumerate(zip(query_ends, kv_lens)):
            query_len = end - start
            assert 0 < query_len <= kv_len <= block_table.shape[1] * block_size
            blocks = block_table[seq, :-(-kv_len // block_size)].long()
            seq_key = key[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
            seq_value = value[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
            seq_query = query[start:end].float()
            for head in range(num_heads):
                scores = seq_query[:, head] @ seq_key[:, head // group].T * scale
                # rightDownCausal: query row i sees keys 0 .. kv_len - query_len + i.
                causal = torch.ones(query_len, kv_len, dtype=torch.bool).tril(kv_len - query_len)
                scores = scores.masked_fill(~causal, float("-inf"))
                output[start:end, head] = (scores.softmax(-1) @ seq_value[:, head // group]).to(query.dtype)
            start = end
        return output, torch.empty(0)


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def make_step(num_heads: int, num_kv_heads: int, seq_shapes: list[tuple[int, int]],
              dtype: torch.dtype, block_size: int = BLOCK_SIZE, seed: int = 0,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step's q/k/v and metadata; each sequence's earlier K/V already sit in `cache`.

    Returns (query, key, value, cache [2, num_blocks, block_size, num_kv_heads, head_dim],
    metadata); block tables are random, non-contiguous and one block longer than needed.
    """
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, generator=generator)
    cache = cache.to(dtype)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    starts, context_lens, tables, slots = [0], [], [], []
    for cached_len, query_len in seq_shapes:
        context_len = cached_len + query_len
        table = [free_blocks.pop() for _ in range(-(-context_len // block_size) + 1)]
        tables.append(torch.tensor(table, dtype=torch.int64))
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached_len, context_len)]
        starts.append(starts[-1] + query_len)
        context_lens.append(context_len)
    num_tokens = starts[-1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    metadata = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64),
                                 query_start_locs=starts, context_lens=context_lens,
                                 block_tables=tables)
    return (rand(num_tokens, num_heads, HEAD_DIM), rand(num_tokens, num_kv_heads, HEAD_DIM),
            rand(num_tokens, num_kv_heads, HEAD_DIM), cache, metadata)


def run_both(backend: NpuFusedPagedAttention, step: tuple[Any, ...],
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(backend output, reference output, backend's cache, reference's cache)."""
    query, key, value, cache, metadata = step
    ours_cache, reference_cache = cache.clone(), cache.clone()
    reference = TorchPagedAttention(backend.num_heads, backend.num_kv_heads, HEAD_DIM)
    ours = backend.forward(query, key, value, ours_cache[0], ours_cache[1], metadata)
    expected = reference.forward(query, key, value, reference_cache[0], reference_cache[1], metadata)
    return ours, expected, ours_cache, reference_cache


# (num_heads, num_kv_heads, per sequence (cached_len, query_len))
CASES = [
    (4, 2, [(0, 9), (5, 1), (30, 4), (17, 3)]),  # GQA: prefill, decode, verify window, chunk
    (4, 4, [(40, 1), (15, 1), (0, 1)]),  # MHA, decode only
    (6, 2, [(0, 37)]),  # one prefill across three blocks
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,seq_shapes", CASES)
def test_fused_path_matches_reference(fake_npu: FakeTorchNpu, dtype: torch.dtype, num_heads: int,
                                      num_kv_heads: int, seq_shapes: list[tuple[int, int]]) -> None:
    backend = NpuFusedPagedAttention(num_heads, num_kv_heads, HEAD_DIM)
    step = make_step(num_heads, num_kv_heads, seq_shapes, dtype, seed=num_heads + len(seq_shapes))
    ours, expected, ours_cache, reference_cache = run_both(backend, step)
    assert backend.num_fused_calls == 1 and backend.num_reference_calls == 0
    assert fake_npu.scatter_calls == 2  # keys, values
    assert torch.equal(ours_cache, reference_cache)  # the same slots written
    torch.testing.assert_close(ours.float(), expected.float(), atol=2e-2, rtol=2e-2)
    call = fake_npu.attention_calls[0]
    assert call["num_key_value_heads"] == num_kv_heads
    assert call["scale"] == pytest.approx(HEAD_DIM**-0.5)
    assert call["actual_seq_lengths_kv"] == [c + q for c, q in seq_shapes]


def test_step_inputs_are_built_once_per_step(fake_npu: FakeTorchNpu) -> None:
    """Every layer of a step reuses one block table tensor (the metadata object is the step)."""
    backend = NpuFusedPagedAttention(4, 2, HEAD_DIM)
    query, key, value, cache, metadata = make_step(4, 2, [(3, 2), (20, 1)], torch.bfloat16)
    for _ in range(3):
        backend.forward(query, key, value, cache[0], cache[1], metadata)
    tables = {id(call["block_table"]) for call in fake_npu.attention_calls}
    assert len(fake_npu.attention_calls) == 3 and len(tables) == 1


@pytest.mark.parametrize("dtype,block_size", [(torch.float32, 16), (torch.bfloat16, 8)])
def test_inputs_the_kernel_does_not_take_use_the_reference(
        fake_npu: FakeTorchNpu, dtype: torch.dtype, block_size: int) -> None:
    backend = NpuFusedPagedAttention(4, 2, HEAD_DIM)
    step = make_step(4, 2, [(5, 3), (0, 4)], dtype, block_size=block_size)
    ours, expected, _, _ = run_both(backend, step)
    assert fake_npu.attention_calls == [] and backend.num_reference_calls == 1
    assert torch.equal(ours, expected)


def test_kernel_error_falls_back_once_and_is_remembered(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeTorchNpu(fail_attention=True)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    backend = NpuFusedPagedAttention(4, 2, HEAD_DIM)
    step = make_step(4, 2, [(5, 3), (0, 4)], torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="specdec.layers.attention_npu"):
        ours, expected, _, _ = run_both(backend, step)
        run_both(backend, step)
    assert torch.equal(ours, expected)
    assert len(fake.attention_calls) == 1  # the second step did not try the kernel again
    assert backend.num_reference_calls == 2
    assert sum("refused" in record.message for record in caplog.records) == 1


def test_without_torch_npu_the_reference_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    backend = NpuFusedPagedAttention(4, 2, HEAD_DIM)
    assert backend.torch_npu is None
    ours, expected, _, _ = run_both(backend, make_step(4, 2, [(5, 3)], torch.bfloat16))
    assert torch.equal(ours, expected) and backend.num_reference_calls == 1


@pytest.mark.parametrize("env,device,expected", [
    (None, "npu", NpuFusedPagedAttention),
    (None, "cpu", CpuPagedAttention),
    ("torch", "cpu", TorchPagedAttention),
    ("cpu", "cpu", CpuPagedAttention),
    ("torch", "npu", TorchPagedAttention),
    ("cpu", "npu", TorchPagedAttention),  # the C++ kernel reads host memory only
    ("npu_fused", "cpu", NpuFusedPagedAttention),
])
def test_backend_selection(monkeypatch: pytest.MonkeyPatch, fake_npu: FakeTorchNpu,
                           env: str | None, device: str, expected: type) -> None:
    if env is None:
        monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    else:
        monkeypatch.setenv(ATTENTION_BACKEND_ENV, env)
    # torch.device("npu") needs the real torch_npu: selection reads only the device type.
    fake_device: Any = types.SimpleNamespace(type=device)
    backend = make_attention_backend(fake_device, 4, 2, HEAD_DIM)
    assert type(backend) is expected


def test_unknown_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "flash")
    with pytest.raises(ConfigError, match="auto, torch, cpu, npu_fused"):
        make_attention_backend(torch.device("cpu"), 4, 2, HEAD_DIM)


def test_npu_alloc_conf_default_only_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.device import (
        DEFAULT_NPU_ALLOC_CONF,
        NPU_ALLOC_CONF_ENV,
        configure_npu_allocator,
    )

    monkeypatch.delenv(NPU_ALLOC_CONF_ENV, raising=False)
    assert configure_npu_allocator() == DEFAULT_NPU_ALLOC_CONF == "expandable_segments:True"
    monkeypatch.setenv(NPU_ALLOC_CONF_ENV, "max_split_size_mb:256")
    assert configure_npu_allocator() == "max_split_size_mb:256"
