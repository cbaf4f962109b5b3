"""Batch invariance: whether every row of a forward is computed bit for bit the same way
whatever else is in the call (other sequences, a longer prefill, a cache-hit tail, a verify
window), which makes greedy and seeded answers independent of load, cache and chunking.

specdec's C++ CPU kernels guarantee it in bf16 and fp32 (see `csrc/`): the linears sum each
output in input order whatever the number of rows, and the attention reduces a row over its
keys chunk by chunk in the order a decode of that row takes, also for a prefill chunk. It is
on by default; `VLLM_BATCH_INVARIANT=0` (vLLM's switch, where it is off by default) lets a
long prefill segment's attention go by torch's SDPA instead, whose reduction order depends on
the segment's length (see docs/performance.md for what that saves). Elsewhere (another
device, a CPU without the kernels, float16, tensor parallelism) rounding can depend on the
batch, and the verifier says so (`deterministic_reason`).
"""

from __future__ import annotations

import os

import torch

BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def batch_invariant_requested() -> bool:
    """Whether the kernels are to be batch-invariant: unless `VLLM_BATCH_INVARIANT` is 0."""
    return os.environ.get(BATCH_INVARIANT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def deterministic_reason(forward_is_cpu_stack: bool, lm_head_row_invariant: bool, dtype: torch.dtype,
                         tensor_parallel_size: int) -> str | None:
    """Why a verifier's greedy answers may depend on load, cache or chunking, or None when
    its forward and LM head are the batch-invariant C++ kernels."""
    if not batch_invariant_requested():
        return f"{BATCH_INVARIANT_ENV}=0"
    if tensor_parallel_size != 1:
        return "tensor parallelism (the all-reduce's sums depend on the shards)"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} has no batch-invariant kernel"
    if not forward_is_cpu_stack:
        return "the forward does not run on specdec's C++ CPU kernels"
    if not lm_head_row_invariant:
        return "the LM head does not run on specdec's C++ linear kernel"
    return None
