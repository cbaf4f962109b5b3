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

import mmap

import numpy as np
import torch
from torch import nn

from specdec.layers.cpu_extension import load_extension
from specdec.models.gguf_blocks import (BLOCK_COLUMNS, TYPE_NAMES, QuantFields, dequantize_fields,
                                        kernel_block_bytes, pack_rows, unpack, unpack_columns)


def own_pages(num_bytes: int) -> np.ndarray:
    """A zeroed uint8 array of `num_bytes` in an anonymous mapping of its own, unmapped when
    the last array or tensor on it goes.

    Why: a model's blocks are tens of MB a matrix, below the size (up to 32 MiB) under which
    glibc's malloc serves them from its heap; freed there (the C++ decoder stack copies them
    into its one buffer, `specdec.models.weight_arena`) they stayed resident: ~300 MB at
    0.8B Q4_0 (a 455 MB file)."""
    pages = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype=np.uint8, count=num_bytes)


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
        packed, table = pack_rows(parts, allocate=own_pages)
        self._hold(packed, table, int(parts[0].codes.shape[1]), bias)

    @classmethod
    def from_blocks(cls, packed: np.ndarray, table: np.ndarray, in_features: int,
                    bias: torch.Tensor | None = None) -> GgufLinear:
        """The layer on blocks already laid out for rows of `in_features` (`pack_rows`'
        operands), kept as they are."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear._hold(packed, table, in_features, bias)
        return linear

    def _hold(self, packed: np.ndarray, table: np.ndarray, in_features: int, bias: torch.Tensor | None) -> None:
        self.in_features = in_features
        self.out_features = int(table[:, 3].sum())
        self.qtypes = tuple(sorted({TYPE_NAMES[int(qtype)] for qtype in np.unique(table[:, 1])}))
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
    """`nn.Embedding`'s lookup on a GGUF file's quantized embedding, each looked-up row
    dequantised (as transformers dequantises the file) and rounded to `dtype`, so the table
    costs the file's bytes, not 16 bits a weight. Its rows: the file's (a copy of them,
    `raw_rows`), or, where the LM head is tied to the embedding, `head`'s blocks (the same
    values, read back by `unpack_columns`): the matrix is held once."""

    rows: torch.Tensor  # uint8 [num_embeddings, row bytes]: the file's rows (untied only)

    def __init__(self, raw_rows: np.ndarray | None, qtype: int, embedding_dim: int, dtype: torch.dtype,
                 head: GgufLinear | None = None) -> None:
        super().__init__()
        self.qtype, self.embedding_dim, self.dtype = qtype, embedding_dim, dtype
        # Not a submodule: the head stays the model's lm_head alone (and its blocks one tensor,
        # which `move_into_arena` moves for both).
        self._head = () if head is None else (head,)
        if head is not None:
            table = head.table
            num_blocks = table.shape[0]
            block_bytes = kernel_block_bytes(qtype, embedding_dim)
            one_part = (head.qtypes == (TYPE_NAMES[qtype],) and head.in_features == embedding_dim
                        and head.packed.numel() == num_blocks * block_bytes
                        and torch.equal(table[:, 0], torch.arange(num_blocks) * block_bytes)
                        and torch.equal(table[:, 2], torch.arange(num_blocks) * BLOCK_COLUMNS))
            if not one_part:
                raise ValueError(f"a tied embedding reads one {TYPE_NAMES[qtype]} matrix of {embedding_dim} inputs; "
                                 f"the head is {head.extra_repr()}")
            self.num_embeddings = head.out_features
        else:
            assert raw_rows is not None, "the file's rows, or the tied head"
            self.num_embeddings = raw_rows.shape[0]
            # A copy: the file's mapping is read-only and closes with its reader.
            rows = own_pages(raw_rows.nbytes).reshape(raw_rows.shape)
            rows[...] = raw_rows
            self.register_buffer("rows", torch.from_numpy(rows), persistent=False)

    @property
    def blocks(self) -> torch.Tensor:
        """The bytes it looks rows up in: the file's rows, or the tied head's blocks."""
        return self._head[0].packed if self._head else self.rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., dim]
        flat = input_ids.reshape(-1).cpu()
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.num_embeddings:
            raise IndexError(f"token ids out of the embedding's {self.num_embeddings} rows")
        if self._head:
            head = self._head[0]
            ids = flat.numpy()
            fields = unpack_columns(head.packed.numpy(), ids // BLOCK_COLUMNS, ids % BLOCK_COLUMNS, self.qtype,
                                    self.embedding_dim)
        else:
            fields = unpack(self.rows.index_select(0, flat).numpy(), self.qtype, self.embedding_dim)
        values = torch.from_numpy(dequantize_fields(fields))
        return values.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        tied = ", tied to the LM head's blocks" if self._head else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, type={TYPE_NAMES[self.qtype]}{tied}"
