"""`torch.ops.specdec_cpu.linear` on `pack_weight`'s blocks (specdec/layers/csrc/linear_cpu.cpp)
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
from torch import nn

from specdec.layers.cpu_extension import linear_supports, load_extension
from specdec.models.packed_linear import PackedLinear

TILE_ROWS = 10  # kTileRows in linear_cpu.cpp: more rows are split into balanced tiles
# kChunkMinRows and kMaxRowsChunked: rows in [8, 40] take the chunked, prefetching walk
CHUNKED_ROWS = (8, 40)
# Relative error of one product against float64: fp32 summation, plus the output's rounding.
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 8e-3}


def _with_kernel(dtype: torch.dtype, *values: object) -> object:
    """A parameter set that needs this machine's kernel for `dtype`."""
    return pytest.param(dtype, *values, id="-".join(str(v).removeprefix("torch.") for v in (dtype, *values)),
                        marks=pytest.mark.skipif(not linear_supports(dtype),
                                                 reason=f"no {dtype} kernel without AVX-512 (BF16)"))


DTYPES = [_with_kernel(dtype) for dtype in (torch.float32, torch.bfloat16)]
# The operators' own checks, registered by any build (a failed build fails CI at its start:
# tests/support/cpu_kernels.py).
needs_extension = pytest.mark.skipif(load_extension() is None, reason="specdec's C++ CPU kernels cannot be built here")


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
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 9, TILE_ROWS, TILE_ROWS + 1, 13, 16, 17, 21, 129])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_matches_float64(dtype: torch.dtype, in_features: int, out_features: int, num_rows: int,
                         bias: bool) -> None:
    x, weight, b = _operands(num_rows, in_features, out_features, dtype, bias)
    out = _linear(x, weight, b)
    _assert_close_to_exact(out, x, weight, b)


@pytest.mark.parametrize(("dtype", "num_rows", "in_features"), [
    _with_kernel(dtype, n, k) for dtype in (torch.float32, torch.bfloat16)
    for n in (2, 4, 7, 8, 9, 10, 11, 16, 17, 32, CHUNKED_ROWS[1], CHUNKED_ROWS[1] + 1, 65, 300, 301)
    for k in (576, 1537)])
def test_a_row_is_bit_identical_alone_and_in_a_batch(dtype: torch.dtype, num_rows: int, in_features: int) -> None:
    # What makes a decode token's projections equal to the same token's in a verify window or
    # a prefill: a row alone and among 1, 7, 64 and 300 others (one row takes the plain
    # walk, 8-40 the chunked one, more the plain walk in tiles; 1537: an odd last pair row).
    x, weight, bias = _operands(num_rows, in_features, 962, dtype, bias=True, seed=1)
    packed = torch.ops.specdec_cpu.pack_weight(weight)
    together = torch.ops.specdec_cpu.linear(x, packed, bias, 962)
    alone = torch.cat([torch.ops.specdec_cpu.linear(x[row:row + 1], packed, bias, 962) for row in range(num_rows)])
    differing = (alone != together).any(dim=1).nonzero().flatten().tolist()
    assert not differing, f"rows {differing} of {num_rows} differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [3, 12])  # the plain walk, the chunked one
def test_multithreaded_split_matches_one_thread(dtype: torch.dtype, num_rows: int) -> None:
    x, weight, bias = _operands(num_rows, 576, 4099, dtype, bias=True, seed=2)
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


@needs_extension
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


@needs_extension
def test_an_unpacked_weight_is_refused() -> None:
    with pytest.raises(RuntimeError, match="is not pack_weight's"):
        torch.ops.specdec_cpu.linear(torch.zeros(2, 8), torch.zeros(4, 8), None, 4)


@pytest.mark.skipif(not linear_supports(torch.bfloat16), reason="no bf16 kernel without AVX512-BF16")
def test_mixed_dtypes_are_refused() -> None:
    packed = torch.ops.specdec_cpu.pack_weight(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="but the weight is"):
        torch.ops.specdec_cpu.linear(torch.zeros(2, 8), packed, None, 4)


@needs_extension
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


# Int8 weights (`pack_weight_int8`, weight-only quantisation) for bf16 or fp32 rows.
needs_int8 = pytest.mark.skipif(not linear_supports(torch.float32, int8_weights=True),
                                reason="no int8 kernel without AVX512-VBMI")


def _with_int8_kernel(dtype: torch.dtype, *values: object) -> object:
    """A parameter set that needs this machine's int8 kernel for rows of `dtype`."""
    return pytest.param(dtype, *values, id="-".join(str(v).removeprefix("torch.") for v in (dtype, *values)),
                        marks=pytest.mark.skipif(not linear_supports(dtype, int8_weights=True),
                                                 reason=f"no int8 kernel for {dtype} rows here"))


INT8_DTYPES = [_with_int8_kernel(dtype) for dtype in (torch.float32, torch.bfloat16)]


def _int8_operands(num_rows: int, in_features: int, out_features: int, dtype: torch.dtype, bias: bool,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows and a bias of `dtype`, int8 weights over the whole range [-127, 127], float32 scales."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
    weight = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = torch.rand(out_features, generator=generator) / (127 * in_features**0.5)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    return x, weight, scales, b


def _int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    packed = torch.ops.specdec_cpu.pack_weight_int8(weight)
    return torch.ops.specdec_cpu.linear(x, packed, bias, weight.shape[0], scales)


@pytest.mark.parametrize("dtype", INT8_DTYPES)
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 576), (48, 80), (33, 13), (17, 47), (1, 32)])
@pytest.mark.parametrize("num_rows", [1, 3, 9, TILE_ROWS, TILE_ROWS + 1, 17, 129])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_int8_weights_match_float64(dtype: torch.dtype, in_features: int, out_features: int, num_rows: int,
                                    bias: bool) -> None:
    x, weight, scales, b = _int8_operands(num_rows, in_features, out_features, dtype, bias)
    out = _int8_linear(x, weight, scales, b)
    # The weight the kernel multiplies by: each int8 step times its column's scale.
    _assert_close_to_exact(out, x, weight.double() * scales.double()[:, None], b)


@pytest.mark.parametrize(("dtype", "num_rows", "in_features"), [
    _with_int8_kernel(dtype, n, k) for dtype in (torch.float32, torch.bfloat16)
    for n in (2, 7, 8, 9, 10, 11, 16, 17, CHUNKED_ROWS[1], CHUNKED_ROWS[1] + 1, 65, 300, 301)
    for k in (576, 1537)])
def test_an_int8_row_is_bit_identical_alone_and_in_a_batch(dtype: torch.dtype, num_rows: int, in_features: int) -> None:
    x, weight, scales, bias = _int8_operands(num_rows, in_features, 962, dtype, bias=True, seed=1)
    packed = torch.ops.specdec_cpu.pack_weight_int8(weight)
    together = torch.ops.specdec_cpu.linear(x, packed, bias, 962, scales)
    alone = torch.cat([torch.ops.specdec_cpu.linear(x[row:row + 1], packed, bias, 962, scales)
                       for row in range(num_rows)])
    differing = (alone != together).any(dim=1).nonzero().flatten().tolist()
    assert not differing, f"rows {differing} of {num_rows} differ"


@pytest.mark.parametrize("dtype", INT8_DTYPES)
def test_int8_rows_are_bit_identical_whatever_the_walk(dtype: torch.dtype) -> None:
    # 45 rows go in tiles of 9, 40 in chunks of four tiles of 10, 9 in one tile, 1 alone:
    # each row's outputs must not depend on which (see BlockOutput::store).
    x, weight, scales, bias = _int8_operands(45, 576, 3072, dtype, bias=True, seed=3)
    packed = torch.ops.specdec_cpu.pack_weight_int8(weight)
    every = torch.ops.specdec_cpu.linear(x, packed, bias, 3072, scales)
    for num_rows in (1, 7, CHUNKED_ROWS[0], 9, 11, CHUNKED_ROWS[1]):
        some = torch.ops.specdec_cpu.linear(x[:num_rows], packed, bias, 3072, scales)
        assert torch.equal(some, every[:num_rows]), f"{num_rows} rows"


@pytest.mark.parametrize("dtype", INT8_DTYPES)
@pytest.mark.parametrize("num_rows", [3, 12])  # the plain walk, the chunked one
def test_int8_multithreaded_split_matches_one_thread(dtype: torch.dtype, num_rows: int) -> None:
    x, weight, scales, bias = _int8_operands(num_rows, 576, 4099, dtype, bias=True, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _int8_linear(x, weight, scales, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_int8_linear(x, weight, scales, bias), single)


@needs_int8
def test_the_int8_packing_stores_sign_and_magnitude_in_unpack_order() -> None:
    # Each block's pair row is 64 bytes: bytes 16 L + j (j < 8) of each 128-bit lane L hold
    # columns 0-15 (a pair each), bytes 16 L + 8 + j columns 16-31, as the kernel's unpacks
    # take them; a byte is the sign (0x80) and the magnitude.
    weight = (torch.arange(40 * 5) % 255 - 127).to(torch.int8).reshape(40, 5)
    packed = torch.ops.specdec_cpu.pack_weight_int8(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 32, 2) and packed.is_contiguous()
    lanes = packed.reshape(2, 3, 4, 2, 8)  # [block, pair, lane, half, j]
    words = lanes.permute(0, 1, 3, 2, 4).reshape(2, 3, 2, 16, 2)  # [block, pair, half, column, k]
    codes = words.permute(0, 2, 3, 1, 4).reshape(64, 6).long()  # [block * 32 + column, k]
    decoded = torch.where(codes >= 0x80, -(codes - 0x80), codes)
    assert torch.equal(decoded[:40, :5], weight.long())
    assert not decoded[40:].any() and not decoded[:, 5:].any()


@needs_int8
@pytest.mark.parametrize(("x_dtype", "scales", "words"), [
    (torch.bfloat16, None, "need their scales"),
    (torch.bfloat16, torch.ones(5), "need their scales"),  # the wrong width
    (torch.bfloat16, torch.ones(4, dtype=torch.bfloat16), "need their scales"),
    (torch.float16, torch.ones(4), "has no Half x int8 weights kernel"),
])
def test_bad_int8_operands_are_refused(x_dtype: torch.dtype, scales: torch.Tensor | None, words: str) -> None:
    packed = torch.ops.specdec_cpu.pack_weight_int8(torch.ones(4, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match=words):
        torch.ops.specdec_cpu.linear(torch.zeros(2, 8, dtype=x_dtype), packed, None, 4, scales)


@needs_int8
def test_int8_packing_refuses_what_is_not_symmetric_int8() -> None:
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        torch.ops.specdec_cpu.pack_weight_int8(torch.full((4, 8), -128, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="expects a CPU int8 weight"):
        torch.ops.specdec_cpu.pack_weight_int8(torch.ones(4, 8))


@pytest.mark.skipif(not linear_supports(torch.bfloat16), reason="no bf16 kernel without AVX512-BF16")
def test_scales_with_unquantised_weights_are_refused() -> None:
    packed = torch.ops.specdec_cpu.pack_weight(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="scales go with int8 weights only"):
        torch.ops.specdec_cpu.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, None, 4, torch.ones(4))


@pytest.mark.parametrize("dtype", INT8_DTYPES)
def test_a_compiled_int8_layer_calls_the_operator(dtype: torch.dtype) -> None:
    # Where the stack is not used (SPECDEC_CPU_STACK=0), a compiled forward traces the
    # int8 layer: the operator with its scales, as eagerly.
    torch.manual_seed(6)
    packed = PackedLinear(nn.Linear(64, 40, bias=True).to(dtype), "int8", keep_weight=False)
    assert packed.own_int8 and packed.packed.dtype == torch.uint8
    compiled = torch.compile(packed, dynamic=True)
    with torch.inference_mode():
        for num_rows in (1, 3, TILE_ROWS + 1, 130):
            x = torch.randn(num_rows, 64).to(dtype)
            assert torch.equal(compiled(x), packed(x)), f"{num_rows} rows"
