"""Paged attention: which backend a model runs, chosen in one place.

The metadata and the backend interface are in `attention_metadata`, the plain-torch
reference in `attention_torch`, the C++ CPU and fused NPU backends in `attention_cpu` and
`attention_npu`; every backend depends on the metadata module, never on this one. The
names are re-exported here for the models.
"""

from __future__ import annotations

import os

import torch

from specdec.errors import ConfigError
from specdec.layers.attention_metadata import AttentionBackend, AttentionMetadata
from specdec.layers.attention_torch import TorchPagedAttention, write_kv

__all__ = ["ATTENTION_BACKENDS", "ATTENTION_BACKEND_ENV", "AttentionBackend", "AttentionMetadata",
           "TorchPagedAttention", "attention_backend_from_env", "make_attention_backend",
           "write_kv"]

# Which backend `make_attention_backend` builds: auto (the fused NPU backend on npu, the C++
# kernel on cpu, the reference elsewhere), torch (the reference everywhere), cpu (the C++
# kernel on cpu; the reference where it cannot be built) or npu_fused (the NPU backend on any
# device; it falls back to the reference where its op is missing or refuses a shape).
ATTENTION_BACKEND_ENV = "SPECDEC_ATTENTION_BACKEND"
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "npu_fused")


def attention_backend_from_env() -> str:
    """$SPECDEC_ATTENTION_BACKEND, "auto" where unset: the default of the verifier's config
    field and the choice of a process without one (a drafter, a tensor-parallel rank)."""
    return os.environ.get(ATTENTION_BACKEND_ENV, "auto").strip().lower() or "auto"


def make_attention_backend(device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                           choice: str | None = None) -> AttentionBackend:
    """The one place a model's attention backend is chosen: `choice` (one of
    ATTENTION_BACKENDS), None for `attention_backend_from_env()`."""
    choice = attention_backend_from_env() if choice is None else choice
    if choice not in ATTENTION_BACKENDS:
        raise ConfigError(f"{ATTENTION_BACKEND_ENV}={choice!r} is not supported; allowed values: "
                          f"{', '.join(ATTENTION_BACKENDS)}", param=ATTENTION_BACKEND_ENV)
    if choice == "npu_fused" or (choice == "auto" and device.type == "npu"):
        from specdec.layers.attention_npu import NpuFusedPagedAttention

        return NpuFusedPagedAttention(num_heads, num_kv_heads, head_dim)
    if choice in ("cpu", "auto") and device.type == "cpu":
        from specdec.layers.attention_cpu import CpuPagedAttention
        from specdec.layers.cpu_extension import load_extension

        kernel = load_extension()
        if kernel is not None:
            return CpuPagedAttention(kernel, num_heads, num_kv_heads, head_dim)
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)
