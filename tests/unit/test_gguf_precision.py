"""`specdec.models.gguf_precision`: a quantised GGUF rewritten at F32 / F16 / BF16 / Q8_0 keeps its
metadata and holds the dequantised values."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from specdec.models.gguf_precision import (
    convert_gguf,
    gguf_at_precision,
    precision_for_dtype,
)

Q8 = gguf.GGMLQuantizationType.Q8_0


def _write_quantised(path: Path) -> dict[str, np.ndarray]:
    """A small llama-like GGUF: one Q8_0 matrix [out 4, in 64], one F32 norm, tokenizer
    metadata. Returns the dequantised values by tensor name."""
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((4, 64)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float32)
    quantised = gguf.quants.quantize(matrix, Q8)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_file_type(7)  # MOSTLY_Q8_0
    writer.add_token_list(["<a>", "<b>", "c"])
    writer.add_chat_template("{{ messages }}")
    writer.add_tensor("blk.0.attn_q.weight", quantised, raw_shape=quantised.shape, raw_dtype=Q8)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"blk.0.attn_q.weight": gguf.quants.dequantize(quantised, Q8).reshape(4, 64),
            "blk.0.attn_norm.weight": norm}


def _tensors(path: Path) -> dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(reversed([int(n) for n in t.shape])))) for t in reader.tensors}


@pytest.mark.parametrize("precision, matrix_type, tolerance", [
    ("F32", gguf.GGMLQuantizationType.F32, 0.0),
    ("F16", gguf.GGMLQuantizationType.F16, 1e-3),
    ("BF16", gguf.GGMLQuantizationType.BF16, 1e-2),
    ("Q8_0", Q8, 2e-2),  # requantised: int8 steps of max|block| / 127
])
def test_convert_dequantises_and_keeps_metadata(tmp_path: Path, precision: str,
                                                matrix_type: gguf.GGMLQuantizationType,
                                                tolerance: float) -> None:
    source = tmp_path / "model.Q8_0.gguf"
    expected = _write_quantised(source)
    converted = convert_gguf(source, tmp_path / f"model.{precision}.gguf", precision)
    tensors = _tensors(converted)
    matrix_kind, matrix = tensors["blk.0.attn_q.weight"]
    norm_kind, norm = tensors["blk.0.attn_norm.weight"]
    assert matrix_kind == matrix_type and norm_kind == gguf.GGMLQuantizationType.F32
    assert matrix.shape == (4, 64)
    np.testing.assert_allclose(matrix, expected["blk.0.attn_q.weight"], rtol=tolerance, atol=tolerance)
    np.testing.assert_array_equal(norm, expected["blk.0.attn_norm.weight"])
    fields = gguf.GGUFReader(converted).fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["tokenizer.ggml.tokens"].contents() == ["<a>", "<b>", "c"]
    assert fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    assert fields["llama.block_count"].contents() == 1
    assert fields["general.file_type"].contents() == {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7}[precision]
    assert not (tmp_path / f"model.{precision}.gguf.partial").exists()


def test_at_precision_converts_once_and_keeps_a_matching_file(tmp_path: Path) -> None:
    source = tmp_path / "model.Q8_0.gguf"
    _write_quantised(source)
    first = gguf_at_precision(source, "F16", tmp_path / "cache")
    assert first == tmp_path / "cache" / "model.Q8_0.F16.gguf"
    stamp = first.stat().st_mtime_ns
    assert gguf_at_precision(source, "F16", tmp_path / "cache").stat().st_mtime_ns == stamp
    # A file already at the precision is used as it is.
    assert gguf_at_precision(first, "F16", tmp_path / "other") == first
    with pytest.raises(ValueError, match="precision"):
        convert_gguf(source, tmp_path / "x.gguf", "Q4_0")


def test_precision_for_dtype() -> None:
    assert precision_for_dtype("bfloat16", "int8") == precision_for_dtype("float32", "int8") == "Q8_0"
    assert precision_for_dtype("float32") == "F32"
    assert precision_for_dtype("bfloat16") == "F16"
    assert precision_for_dtype("float16") == "F16"


def test_q8_0_keeps_a_row_that_is_not_whole_blocks_in_f16(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    odd = rng.standard_normal((3, 40)).astype(np.float32)  # 40 is not a multiple of Q8_0's 32
    writer = gguf.GGUFWriter(tmp_path / "odd.gguf", "llama")
    writer.add_tensor("blk.0.attn_k.weight", odd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    kind, values = _tensors(convert_gguf(tmp_path / "odd.gguf", tmp_path / "odd.Q8_0.gguf", "Q8_0"))[
        "blk.0.attn_k.weight"]
    assert kind == gguf.GGMLQuantizationType.F16
    np.testing.assert_allclose(values, odd, rtol=1e-3, atol=1e-3)
