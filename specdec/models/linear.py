"""Linear layers with a faster fp32 CPU path for few rows (decode and verify steps).

A decode forward on a CPU is bound by reading the weights. For x [M, in] with small M, stock
`F.linear(x, W)` (MKL gemm with a transposed weight) streams W [out, in] at well under the
machine's memory bandwidth (measured here, SmolLM2-135M fp32, 2 cores: ~12 GB/s at M=1,
~7-9 GB/s at M=2..4), while the same product computed as `W @ x.T` (the weight as the
row-major left operand) reads it at ~28 GB/s for M = 2..4. For M = 1 torch routes that
product to gemv, which is as slow as F.linear, so a zero row pads x to two rows. No copy or
repacking of any weight: the gain costs no memory.

Only fp32 CPU inputs with 1 <= M <= SMALL_M rows take this path; everything else (prefill,
large batches, bf16/fp16, accelerators) calls F.linear unchanged. The two paths differ only
by fp32 rounding (summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Largest row count that takes the `W @ x.T` path; measured faster for M = 1..8 and no
# better from M = 12 on (SmolLM2-135M projections, 2 cores).
SMALL_M = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; for few fp32 CPU rows, computed as `weight @ x.T`."""
    # The row count is tested last: under torch.compile a test of it becomes a guard, and
    # only fp32 CPU inputs need one.
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.dim() != 2
        or weight.dim() != 2
        or weight.layout != torch.strided
        or not weight.is_contiguous()
        or not 1 <= x.shape[0] <= SMALL_M
    ):
        return F.linear(x, weight, bias)
    num_rows = x.shape[0]
    if num_rows == 1:  # torch would pick gemv, which reads W as slowly as F.linear
        x = torch.cat((x, x.new_zeros(1, x.shape[1])))
    out = torch.mm(weight, x.t())[:, :num_rows].t().contiguous()  # [num_rows, out_features]
    if bias is not None:
        out = out + bias
    return out


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) whose forward uses `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
