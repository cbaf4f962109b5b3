"""`CpuPagedAttention`: the CPU's paged attention, one C++ call per layer.

The kernel (`specdec/csrc/paged_attention_cpu.cpp`) writes the step's K/V into the paged
cache and attends every query token in one call: a decode token or a verify window reads its
cached rows straight from the blocks in fp32 arithmetic, a prefill chunk goes through torch's
SDPA as `TorchPagedAttention` does. It replaces about twenty dispatcher trips a layer (the
reference's gather, conversions and SDPA per sequence), which cost more than the arithmetic
of a decode step on a small model.

It is built once per machine with torch's C++ extension loader (g++ and ninja; cached under
`TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`). Where it cannot be built (no
compiler, as in the slim container image) `load_kernel` says why and the caller keeps the
reference backend.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

from specdec.attention import AttentionMetadata

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


def _vector_flags() -> list[str]:
    """The instruction sets to compile for: this machine's on x86-64 (AVX-512 or AVX2), the
    compiler's default elsewhere. The flags are part of the build's name, so a cache shared by
    two machines never hands one the other's binary."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    if {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags:
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"]
    if {"avx2", "fma", "f16c"} <= cpu_flags:
        return ["-mavx2", "-mfma", "-mf16c"]
    return []


@functools.cache
def load_kernel() -> ModuleType | None:
    """The compiled kernel module, or None (logged once) where it cannot be built here."""
    from torch.utils import cpp_extension

    flags = ["-O3", "-fopenmp", *_vector_flags()]
    digest = hashlib.sha256((SOURCE.read_text() + " ".join(flags)).encode()).hexdigest()[:12]
    try:
        return cpp_extension.load(name=f"specdec_paged_attention_cpu_{digest}", sources=[str(SOURCE)],
                                  extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # a missing compiler or ninja, or a failed build
        logger.warning("the C++ paged attention could not be built here (%s: %s); "
                       "using the plain-torch reference", type(error).__name__, error)
        return None


class CpuPagedAttention:
    """Paged attention on the CPU through the C++ kernel; same contract and results (to
    rounding) as `TorchPagedAttention`, which it is tested against."""

    def __init__(self, kernel: ModuleType, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None) -> None:
        self.kernel = kernel
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], contiguous
        return self.kernel.paged_attention(query, key, value, key_cache, value_cache, metadata.slot_mapping,
                                           metadata.query_start_locs, metadata.context_lens,
                                           metadata.block_tables, self.scale)
