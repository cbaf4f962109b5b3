"""`GgufLinear`: a linear layer whose weight stays in the GGUF file's quantized blocks.

Why: a decode or verify step on a CPU is bound by reading the weights; a Q4_K_M or Q4_0
file dequantised to bf16 reads ~3.5x the bytes (and holds ~3.5x the memory). This layer
keeps the file's codes and scales (`specdec.models.gguf_blocks` lays them out, exactly the
same values) and multiplies by specdec's C++ kernel (`torch.ops.specdec_cpu.linear` with
the block table as its `scales` operand; `specdec/layers/csrc/gguf_linear_cpu.cpp`), which
decodes them in registers, for rows of bf16 or fp32. Row-invariant like the other kernels.

Numerics: the product of the rows with the dequantised weight (float32, as GGUF's own
dequantisation gives it), summed in fp32 group by group; tests hold it to the float64
product within fp32 summation error (and the output's rounding for bf16 rows).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdec.layers.cpu_extension import load_extension
from specdec.models.gguf_blocks import TYPE_NAMES, QuantFields, dequantize_fields, pack_rows, unpack


def gguf_kernel_supports(dtype: torch.dtype) -> bool:
    """Whether this machine's C++ kernels multiply rows of `dtype` by GGUF blocks (AVX-512
    with BF16 and VBMI; building the extension on first use)."""
    if load_extension() is None:
        return False
    return bool(torch.ops.specdec_cpu.gguf_supports(dtype))


class GgufLinear(nn.Module):
    """`y = x @ W.T + b`, W the row-concatenation of `parts` (each in its own GGUF type)."""

    packed: torch.Tensor  # uint8 [bytes]: the kernel's blocks
    table: torch.Tensor  # int64 [blocks, 4]: each block's offset, GGML type, first column, columns
    bias: torch.Tensor | None

    def __init__(self, parts: list[QuantFields], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        packed, table = pack_rows(parts)
        self.in_features = int(parts[0].codes.shape[1])
        self.out_features = int(sum(part.codes.shape[0] for part in parts))
        self.qtypes = tuple(sorted({TYPE_NAMES[part.qtype] for part in parts}))
        self.register_buffer("packed", torch.from_numpy(packed), persistent=False)
        self.register_buffer("table", torch.from_numpy(table), persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.specdec_cpu.linear(rows, self.packed, self.bias, self.out_features, self.table)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, types={','.join(self.qtypes)}")


class GgufEmbedding(nn.Module):
    """`nn.Embedding`'s lookup on a GGUF file's quantized embedding: the file's rows (blocks)
    kept as they are, each looked-up row dequantised (as transformers dequantises the file)
    and rounded to `dtype`, so the table costs the file's bytes, not 16 bits a weight."""

    blocks: torch.Tensor  # uint8 [num_embeddings, row bytes]: the file's rows

    def __init__(self, raw_rows: np.ndarray, qtype: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype, self.embedding_dim, self.dtype = qtype, embedding_dim, dtype
        self.num_embeddings = raw_rows.shape[0]
        # A copy: the file's mapping is read-only and closes with its reader.
        self.register_buffer("blocks", torch.from_numpy(np.array(raw_rows, copy=True)), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., dim]
        flat = input_ids.reshape(-1).cpu()
        rows = self.blocks.index_select(0, flat).numpy()
        values = torch.from_numpy(dequantize_fields(unpack(rows, self.qtype, self.embedding_dim)))
        return values.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={TYPE_NAMES[self.qtype]}"
