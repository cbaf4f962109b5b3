"""A GGUF file at another precision: the same model, its weights stored as F32, F16, BF16 or
Q8_0.

`bench compare` runs llama.cpp on the model's GGUF. The default model ships only as Q4_1
(with a Q8_0 embedding), while specdec runs it in bfloat16 or float32 after dequantising
that very file. Comparing speeds across precisions says little: llama.cpp reads 4-bit
weights, specdec 16- or 32-bit ones. `convert_gguf` rewrites the file with every quantised
tensor dequantised (by `gguf`, the library transformers uses for the same job) and stored at
the precision asked for; the metadata (architecture, tokenizer, chat template) is copied
unchanged. In F32 the result holds exactly the values specdec computes with; Q8_0 (int8 in
blocks of 32 with an F16 scale each) is llama.cpp's counterpart of specdec's weight-only
int8 (`--quantization int8`: int8 with a scale per output channel).

Terms: GGUF stores shapes innermost-first (`[in, out]` for a linear weight); numpy arrays
from `GGUFReader` and the `dequantize` output are outermost-first (`[out, in]`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

# precision name -> (numpy dtype the tensor is written in, llama.cpp's general.file_type)
PRECISIONS: dict[str, tuple[str, int]] = {"F32": ("float32", 0), "F16": ("float16", 1),
                                          "BF16": ("bfloat16", 32), "Q8_0": ("int8", 7)}
# Elements of a Q8_0 block: a row of another width is stored F16 (as llama.cpp's own
# quantiser falls back for such tensors).
Q8_0_BLOCK = 32
# Fields the writer makes itself, or that change with the precision.
_DERIVED_FIELDS = ("GGUF.", "general.file_type")


def precision_for_dtype(dtype_name: str, quantization: str | None = None) -> str:
    """The llama.cpp precision that matches a torch dtype: float32 -> F32, 16-bit -> F16
    (llama.cpp's CPU kernels read F16 natively; bfloat16 and float16 weigh the same); with
    weight-only int8, Q8_0."""
    if quantization == "int8":
        return "Q8_0"
    return "F32" if dtype_name == "float32" else "F16"


def convert_gguf(source: Path, destination: Path, precision: str) -> Path:
    """Writes `source` with every tensor at `precision` (1-D tensors stay F32, as llama.cpp's
    converter keeps norms); returns `destination`. Written to a temporary name first, so an
    interrupted run leaves no half file behind."""
    import gguf

    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    numpy_dtype, file_type = PRECISIONS[precision]
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    partial = destination.with_name(destination.name + ".partial")
    destination.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(partial, arch)
    for name, field in reader.fields.items():
        if name.startswith(_DERIVED_FIELDS) or name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(file_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32, [out, in]
        values = values.reshape(tuple(reversed([int(n) for n in tensor.shape])))
        if values.ndim == 1:
            writer.add_tensor(tensor.name, values.astype(np.float32))
        elif precision == "BF16" or (precision == "Q8_0" and values.shape[-1] % Q8_0_BLOCK == 0):
            kind = gguf.GGMLQuantizationType[precision]
            raw = gguf.quants.quantize(values, kind)  # uint8 bytes
            writer.add_tensor(tensor.name, raw, raw_shape=raw.shape, raw_dtype=kind)
        elif precision == "Q8_0":
            writer.add_tensor(tensor.name, values.astype(np.float16))
        else:
            writer.add_tensor(tensor.name, values.astype(numpy_dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(destination)
    logger.info("wrote %s (%s, %.0f MB)", destination, precision, destination.stat().st_size / 1e6)
    return destination


def gguf_at_precision(source: Path, precision: str, cache_dir: Path) -> Path:
    """`source` itself when all its matrices are already at `precision`, else a converted
    copy kept in `cache_dir` (made once)."""
    import gguf

    wanted = gguf.GGMLQuantizationType[precision]
    reader = gguf.GGUFReader(source)
    if all(t.tensor_type == wanted for t in reader.tensors if len(t.shape) > 1):
        return source
    destination = cache_dir / f"{source.stem}.{precision}.gguf"
    if destination.exists():
        return destination
    return convert_gguf(source, destination, precision)
