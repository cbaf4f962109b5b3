"""`torch.ops.specdec_cpu.linear` on `pack_weight`'s blocks (specdec/csrc/linear_cpu.cpp)
against float64 arithmetic.

Shapes cover what the kernel splits on: output widths in blocks of 32 and a remainder (one
register of 16 and part of the next, or part of the first), input widths of whole and of
odd bf16 pairs, row counts in tiles of eight with a remainder, up to a prefill chunk's
hundreds. Each output is checked against the float64 product, its bit-identity with the
same row computed alone (row invariance), and the layer wrapping it (`PackedLinear`'s `cpu`
kernel) for what it keeps and under torch.compile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.cpu_extension import linear_supports
from specdec.models.packed_linear import PackedLinear

TILE_ROWS = 8  # kTileRows in linear_cpu.cpp
# Relative error of one product against float64: fp32 summation, plus the output's rounding.
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 8e-3}


def _with_kernel(dtype: torch.dtype, *values: object) -> object:
    """A parameter set that needs this machine's kernel for `dtype`."""
    return pytest.param(dtype, *values, id="-".join(str(v).removeprefix("torch.") for v in (dtype, *values)),
                        marks=pytest.mark.skipif(not linear_supports(dtype),
                                                 reason=f"no {dtype} kernel without AVX-512 (BF16)"))


DTYPES = [_with_kernel(dtype) for dtype in (torch.float32, torch.bfloat16)]


def _operands(num_rows: int, in_features: int, out_features: int, dtype: torch.dtype, bias: bool,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    return x, weight, b


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.specdec_cpu.linear(x, torch.ops.specdec_cpu.pack_weight(weight), bias, weight.shape[0])


def _assert_close_to_exact(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> None:
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    tolerance = TOLERANCES[x.dtype]
    # Against the scale of each output row, so near-zero outputs of large sums are fair.
    scale = exact.abs().amax(dim=1, keepdim=True).clamp(min=1e-3)
    assert out.dtype == x.dtype and out.shape == exact.shape
    assert ((out.double() - exact).abs() / scale).max().item() <= tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 576), (48, 80), (33, 13), (100, 7), (16, 3),
                                                     (17, 47), (1, 32)])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, TILE_ROWS, TILE_ROWS + 1, 13, 16, 129])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_matches_float64(dtype: torch.dtype, in_features: int, out_features: int, num_rows: int,
                         bias: bool) -> None:
    x, weight, b = _operands(num_rows, in_features, out_features, dtype, bias)
    out = _linear(x, weight, b)
    _assert_close_to_exact(out, x, weight, b)


@pytest.mark.parametrize(("dtype", "num_rows"), [
    _with_kernel(dtype, n) for dtype in (torch.float32, torch.bfloat16) for n in (2, 4, 7, 9, 16, 32, 300)])
def test_a_row_is_bit_identical_alone_and_in_a_batch(dtype: torch.dtype, num_rows: int) -> None:
    # What makes a decode token's projections equal to the same token's in a verify window.
    x, weight, bias = _operands(num_rows, 576, 962, dtype, bias=True, seed=1)
    packed = torch.ops.specdec_cpu.pack_weight(weight)
    together = torch.ops.specdec_cpu.linear(x, packed, bias, 962)
    alone = torch.cat([torch.ops.specdec_cpu.linear(x[row:row + 1], packed, bias, 962) for row in range(num_rows)])
    differing = (alone != together).any(dim=1).nonzero().flatten().tolist()
    assert not differing, f"rows {differing} of {num_rows} differ"


@pytest.mark.parametrize("dtype", DTYPES)
def test_multithreaded_split_matches_one_thread(dtype: torch.dtype) -> None:
    x, weight, bias = _operands(3, 576, 4099, dtype, bias=True, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _linear(x, weight, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_linear(x, weight, bias), single)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_input_and_weight_views(dtype: torch.dtype) -> None:
    x, weight, bias = _operands(6, 96, 40, dtype, bias=True, seed=3)
    wide = torch.cat((x, x), dim=1)[:, ::2]  # non-contiguous rows
    out = _linear(wide, weight.t().contiguous().t(), bias)
    _assert_close_to_exact(out, wide, weight, bias)


@pytest.mark.parametrize(("x_shape", "weight_shape", "out_features", "bias_shape", "words"), [
    ((2, 8), (4, 9), 4, None, "is not pack_weight's"),
    ((2, 8), (40, 8), 4, None, "is not pack_weight's"),  # another block count
    ((2, 3, 8), (4, 8), 4, None, "expects x"),
    ((2, 8), (4, 8), 4, (5,), "bias must be"),
])
def test_bad_shapes_are_refused(x_shape: tuple[int, ...], weight_shape: tuple[int, ...], out_features: int,
                                bias_shape: tuple[int, ...] | None, words: str) -> None:
    bias = None if bias_shape is None else torch.zeros(bias_shape)
    packed = torch.ops.specdec_cpu.pack_weight(torch.zeros(weight_shape))
    with pytest.raises(RuntimeError, match=words):
        torch.ops.specdec_cpu.linear(torch.zeros(x_shape), packed, bias, out_features)


def test_an_unpacked_weight_is_refused() -> None:
    with pytest.raises(RuntimeError, match="is not pack_weight's"):
        torch.ops.specdec_cpu.linear(torch.zeros(2, 8), torch.zeros(4, 8), None, 4)


@pytest.mark.skipif(not linear_supports(torch.bfloat16), reason="no bf16 kernel without AVX512-BF16")
def test_mixed_dtypes_are_refused() -> None:
    packed = torch.ops.specdec_cpu.pack_weight(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="but the weight is"):
        torch.ops.specdec_cpu.linear(torch.zeros(2, 8), packed, None, 4)


def test_a_dtype_without_a_kernel_is_refused() -> None:
    with pytest.raises(RuntimeError, match="has no Half kernel"):
        torch.ops.specdec_cpu.pack_weight(torch.zeros(4, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_packing_puts_each_column_in_its_block(dtype: torch.dtype) -> None:
    # [out, in] -> [blocks of 32 columns, input pairs, 32, pair], zero-padded: what the
    # kernel's loads assume.
    weight = torch.arange(40 * 5, dtype=torch.float32).reshape(40, 5).to(dtype)
    packed = torch.ops.specdec_cpu.pack_weight(weight)
    pair = 2 if dtype == torch.bfloat16 else 1
    assert packed.shape == (2, -(-5 // pair), 32, pair) and packed.is_contiguous()
    unpacked = packed.permute(0, 2, 1, 3).reshape(64, -1)
    assert torch.equal(unpacked[:40, :5], weight)
    assert not unpacked[40:].any() and not unpacked[:, 5:].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_layer_keeps_only_a_shared_weight_and_matches(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    layer = nn.Linear(64, 40, bias=True).to(dtype)
    packed = PackedLinear(layer, "cpu", keep_weight=False)
    assert packed.weight is None and packed.packed.shape == torch.ops.specdec_cpu.pack_weight(layer.weight).shape
    assert PackedLinear(layer, "cpu", keep_weight=True).weight is layer.weight  # a tied embedding's
    x = torch.randn(2, 3, 64).to(dtype)
    with torch.inference_mode():
        out = packed(x)
    assert out.shape == (2, 3, 40)
    _assert_close_to_exact(out.reshape(6, 40), x.reshape(6, 64), layer.weight.detach(), layer.bias.detach())


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_layer_calls_the_operator(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    packed = PackedLinear(nn.Linear(64, 40, bias=False).to(dtype), "cpu", keep_weight=False)
    compiled = torch.compile(packed, dynamic=True)
    with torch.inference_mode():
        for num_rows in (1, 3, TILE_ROWS + 1, 130):
            x = torch.randn(num_rows, 64).to(dtype)
            assert torch.equal(compiled(x), packed(x)), f"{num_rows} rows"


def test_a_dtype_without_a_kernel_is_refused_by_the_layer() -> None:
    with pytest.raises(ValueError, match="no torch.float16 path"):
        PackedLinear(nn.Linear(8, 4).to(torch.float16), "cpu", keep_weight=False)
