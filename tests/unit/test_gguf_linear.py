"""GGUF's quantized formats on specdec's C++ kernel (`specdec/layers/csrc/gguf_linear_cpu.cpp`)
against the `gguf` package's own dequantisation.

Random blocks of each type (every code and 6-bit scale value, f16 scales of mixed sign),
odd output widths (a partial block of 32 columns), and the row counts of a decode (1), a
verify window (5, 9) and a prefill chunk (64), on each path the kernel has for bf16 rows
(`vdpbf16ps` dot products, and AMX tile products where the CPU has them). The tolerance: the float64 product with the
dequantised weight, within fp32 summation error (2e-5 of the sum of the products'
magnitudes, the scale and min terms apart) plus, for bf16 rows, the output's rounding
(2^-8 of the value). And row invariance: a row's outputs are bit-identical alone and in any
batch.
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch

from specdec.models.gguf_blocks import (BLOCK_COLUMNS, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, TYPE_NAMES, QuantFields,
                                        dequantize_fields, inputs_per_block, pack_rows, unpack, unpack_columns)
from specdec.models.gguf_linear import GgufLinear, gguf_kernel_supports

TYPES = (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)
# Byte offsets of each type's f16 fields within a block (random bytes there could be NaN).
_F16_FIELDS = {Q8_0: (0,), Q4_0: (0,), Q4_1: (0, 2), Q4_K: (0, 2), Q6_K: (208,)}
_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20, Q4_K: 144, Q6_K: 210}
SUM_TOLERANCE = 2e-5
BF16_ROUNDING = 2.0**-8

needs_kernel = pytest.mark.skipif(not gguf_kernel_supports(torch.float32),
                                  reason="no GGUF kernel here (needs AVX-512 with BF16 and VBMI)")


@pytest.fixture(params=["avx512", "amx"])
def kernel_path(request: pytest.FixtureRequest) -> object:
    """Runs the test with bf16 rows on one of the kernel's paths (fp32 rows take the AVX-512
    one either way), restoring the setting after."""
    before = torch.ops.specdec_cpu.gguf_amx(None)
    if request.param == "amx" and not torch.ops.specdec_cpu.gguf_amx(True):
        pytest.skip("this CPU has no AMX tiles with bf16 products (or Linux does not grant their state)")
    torch.ops.specdec_cpu.gguf_amx(request.param == "amx")
    yield request.param
    torch.ops.specdec_cpu.gguf_amx(before)


def row_bytes(qtype: int, in_features: int) -> int:
    """A row's bytes in the file, by the gguf package's block sizes."""
    inputs, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    return in_features // inputs * size


def dequantized_weight(parts: list[QuantFields]) -> torch.Tensor:
    """The float32 weight [out, in] that `GgufLinear(parts)` multiplies by."""
    return torch.from_numpy(np.concatenate([dequantize_fields(part) for part in parts]))


def random_blocks(qtype: int, num_rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Raw rows [num_rows, row_bytes] of random blocks: random codes and scale bytes, finite
    f16 scales (some negative)."""
    rng = np.random.default_rng(seed)
    size = _BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(num_rows, in_features // inputs_per_block(qtype), size), dtype=np.uint8)
    for start in _F16_FIELDS[qtype]:
        scales = (rng.standard_normal((num_rows, blocks.shape[1])) * 0.02).astype(np.float16)
        blocks[..., start:start + 2] = scales.view(np.uint8).reshape(num_rows, blocks.shape[1], 2)
    return blocks.reshape(num_rows, row_bytes(qtype, in_features))


def _gguf_dequantized(raw: np.ndarray, qtype: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).astype(np.float32)


def _magnitudes(fields: QuantFields) -> np.ndarray:
    """Per weight, the size of the terms the kernel sums apart: |scale code| + |min| where
    the type has a min, else |weight|."""
    num_rows, in_features = fields.codes.shape
    codes = fields.codes.astype(np.float32)
    if fields.qtype == Q4_1:
        d, m = (np.abs(f.astype(np.float32)) for f in fields.header)
        return (d * codes.reshape(num_rows, -1, 32) + m).reshape(num_rows, in_features)
    if fields.qtype == Q4_K:
        d, dmin, scales, mins = (np.abs(f.astype(np.float32)) for f in fields.header)
        grouped = codes.reshape(num_rows, -1, 8, 32)
        return ((d * scales)[..., None] * grouped + (dmin * mins)[..., None]).reshape(num_rows, in_features)
    return np.abs(dequantize_fields(fields))


def _assert_matches(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, magnitudes: torch.Tensor,
                    bias: torch.Tensor | None) -> None:
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    bound = x.double().abs() @ magnitudes.double().T
    allowed = SUM_TOLERANCE * bound + 1e-30
    if x.dtype == torch.bfloat16:
        allowed = allowed + BF16_ROUNDING * exact.abs()
    assert out.dtype == x.dtype and out.shape == exact.shape
    excess = ((out.double() - exact).abs() - allowed).max().item()
    assert excess <= 0, f"off by {excess:.3g} beyond the tolerance"


@pytest.mark.parametrize("qtype", TYPES, ids=[TYPE_NAMES[t] for t in TYPES])
def test_fields_hold_exactly_the_files_values(qtype: int) -> None:
    in_features = 512
    raw = random_blocks(qtype, 37, in_features, seed=qtype)
    fields = unpack(raw, qtype, in_features)
    np.testing.assert_array_equal(dequantize_fields(fields), _gguf_dequantized(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=[TYPE_NAMES[t] for t in TYPES])
def test_rows_read_back_from_the_kernels_blocks(qtype: int) -> None:
    """A tied embedding looks its rows up in the LM head's blocks: `unpack_columns` gives
    back exactly the fields (so the dequantised rows) that were packed, any row, in any
    order, the last partial block of 32 included."""
    in_features, num_rows = max(512, inputs_per_block(qtype)), 77
    raw = random_blocks(qtype, num_rows, in_features, seed=qtype)
    fields = unpack(raw, qtype, in_features)
    packed, _ = pack_rows([fields])
    rows = np.array([76, 0, 31, 32, 5, 5, 64, 63, 40])
    read = unpack_columns(packed, rows // BLOCK_COLUMNS, rows % BLOCK_COLUMNS, qtype, in_features)
    np.testing.assert_array_equal(read.codes, fields.codes[rows])
    assert len(read.header) == len(fields.header)
    for got, expected in zip(read.header, fields.header):
        assert got.dtype == expected.dtype and got.shape == expected[rows].shape
        np.testing.assert_array_equal(got.view(np.uint8), expected[rows].view(np.uint8))
    values = dequantize_fields(read)
    np.testing.assert_array_equal(values.view(np.uint32), dequantize_fields(fields)[rows].view(np.uint32))
    np.testing.assert_array_equal(values, _gguf_dequantized(raw, qtype)[rows])


def _shapes(qtype: int) -> list[tuple[int, int]]:
    unit = inputs_per_block(qtype)
    return [(unit, 45), (3 * unit, 7), (2 * unit, 70), (max(512, unit), 97)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=[TYPE_NAMES[t] for t in TYPES])
@pytest.mark.parametrize("num_rows", [1, 5, 9, 17, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_matches_dequantise_then_matmul(dtype: torch.dtype, qtype: int, num_rows: int, bias: bool,
                                        kernel_path: str) -> None:
    for shape_index, (in_features, out_features) in enumerate(_shapes(qtype)):
        raw = random_blocks(qtype, out_features, in_features, seed=shape_index)
        fields = unpack(raw, qtype, in_features)
        generator = torch.Generator().manual_seed(shape_index)
        x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
        b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
        layer = GgufLinear([fields], b)
        oracle = torch.from_numpy(_gguf_dequantized(raw, qtype))
        _assert_matches(layer(x), x, oracle, torch.from_numpy(_magnitudes(fields)), b)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=[TYPE_NAMES[t] for t in TYPES])
def test_a_row_is_bit_identical_alone_and_in_a_batch(dtype: torch.dtype, qtype: int, kernel_path: str) -> None:
    in_features, out_features = 512, 300  # 10 blocks: both threads take some
    fields = unpack(random_blocks(qtype, out_features, in_features, seed=1), qtype, in_features)
    layer = GgufLinear([fields], torch.randn(out_features).to(dtype))
    x = torch.randn(70, in_features, generator=torch.Generator().manual_seed(2)).to(dtype)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    # Around the tiles of 6 rows (vdpbf16ps) and, on the AMX path, the rows whose sums stay in
    # registers (8), the one or two tiles that read a ring of decoded products (16 rows, 8 for
    # Q6_K, each) and the block decoded whole beyond them.
    for num_rows in (2, 5, 6, 7, 8, 9, 13, 16, 17, 32, 33, 64, 70):
        assert torch.equal(layer(x[:num_rows]), alone[:num_rows]), f"{num_rows} rows"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_fused_matrix_of_mixed_types(dtype: torch.dtype, kernel_path: str) -> None:
    """Q4_K_M's fused qkv: q and k at Q4_K, v at Q6_K, parts of widths not a multiple of 32."""
    in_features = 256
    parts = [unpack(random_blocks(qtype, rows, in_features, seed=rows), qtype, in_features)
             for qtype, rows in ((Q4_K, 40), (Q4_K, 24), (Q6_K, 24), (Q8_0, 33), (Q4_1, 5), (Q4_0, 64))]
    layer = GgufLinear(parts)
    assert layer.out_features == 190 and layer.qtypes == ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0")
    x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(3)).to(dtype)
    magnitudes = torch.from_numpy(np.concatenate([_magnitudes(part) for part in parts]))
    _assert_matches(layer(x), x, dequantized_weight(parts), magnitudes, None)


@needs_kernel
def test_a_table_that_does_not_match_its_blocks_is_refused() -> None:
    fields = unpack(random_blocks(Q4_0, 64, 64), Q4_0, 64)
    layer = GgufLinear([fields])
    x = torch.randn(1, 64)
    table = layer.table.clone()
    table[1, 0] += 1  # the second block's offset
    with pytest.raises(RuntimeError, match="out of order"):
        torch.ops.specdec_cpu.linear(x, layer.packed, None, 64, table)
    table = layer.table.clone()
    table[0, 1] = 6  # Q5_0: not a type the kernel reads
    with pytest.raises(RuntimeError, match="GGML type 6"):
        torch.ops.specdec_cpu.linear(x, layer.packed, None, 64, table)
    with pytest.raises(RuntimeError, match="holds"):
        torch.ops.specdec_cpu.linear(x, layer.packed[:-1].clone(), None, 64, layer.table)
    with pytest.raises(RuntimeError, match="block table"):
        torch.ops.specdec_cpu.linear(x, layer.packed, None, 64)


@needs_kernel
def test_bf16_rows_take_the_amx_path_where_the_cpu_has_it() -> None:
    flags = set(open("/proc/cpuinfo").read().split()) if sys.platform == "linux" else set()
    assert torch.ops.specdec_cpu.gguf_amx(None) == ({"amx_tile", "amx_bf16"} <= flags)
