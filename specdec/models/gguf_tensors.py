"""A GGUF file's tensors read as a Hugging Face checkpoint's: one at a time, by HF name,
dequantised to float32.

Why: a GGUF model's directory in the cache (`specdec.models.model_files`) holds only its
config and tokenizer; the weights stay in the file. Writing them out as float32 safetensors
took 4 bytes a weight on disk (12 GB for a 3B model) and a conversion of minutes. The loader
reads the file instead, tensor by tensor, with exactly the values transformers' conversion
saved: `gguf.quants.dequantize` (the function transformers calls) in float32, llama.cpp's
per-head q/k row order undone for a Llama (as transformers undoes it).

Tensors with no HF counterpart (llama.cpp's `rope_freqs`, which the config's RoPE settings
already describe) are passed over, as transformers passes them over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.models.gguf_names import hf_tensor_name, rope_permutation


def iter_gguf_tensors(source: Path | Any, wanted: Callable[[str], bool] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for each tensor of `source` (a GGUF file, or a `GGUFReader`
    already open on one: parsing a file's metadata takes seconds) whose HF name `wanted`
    accepts (all when None); the rest are never dequantised."""
    import gguf

    reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    heads = int(reader.fields[f"{arch}.attention.head_count"].contents())
    kv_field = reader.fields.get(f"{arch}.attention.head_count_kv")
    rope_heads = {"attn_q": heads, "attn_k": int(kv_field.contents()) if kv_field is not None else heads}
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name)
        if hf_name is None or (wanted is not None and not wanted(hf_name)):
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = values.reshape(tuple(reversed([int(n) for n in tensor.shape])))  # [out, in]
        role = tensor.name.split(".")[-2]
        if arch == "llama" and role in rope_heads:
            values = values[np.argsort(rope_permutation(values.shape[0], rope_heads[role]))]
        yield hf_name, torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
