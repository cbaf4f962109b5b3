"""specdec's C++ kernels for the CPU, built once per machine into one extension module.

- `csrc/paged_attention_cpu.cpp`: paged attention in one call per layer (`attention_cpu`).
- `csrc/linear_cpu.cpp`: the linear `torch.ops.specdec_cpu.linear` on a weight packed by
  `torch.ops.specdec_cpu.pack_weight` (or, weight-only int8 with a scale per output column,
  `pack_weight_int8`), torch operators (so a compiled graph calls it without Python in
  between), used by `PackedLinear`'s `cpu` and `int8` kernels.
- `csrc/decoder_cpu.cpp`: every decoder layer of a Llama-family model in one call, built on
  the two above (`specdec.models.cpu_stack`). `csrc/cpu_kernels.h` declares what the files
  share.

They are built with torch's C++ extension loader (g++ and ninja; cached under
`TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`, with the sources and the
instruction-set flags in the build's name, so a cache shared by two machines never hands one
the other's binary). Where they cannot be built (no compiler, as in the slim container
image) `load_extension` says why once and callers keep the plain-torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_attention_cpu.cpp", "linear_cpu.cpp", "decoder_cpu.cpp"))
HEADERS = (CSRC / "cpu_kernels.h",)


def _vector_flags() -> list[str]:
    """The instruction sets to compile for: this machine's on x86-64 (AVX-512, with its BF16
    dot products where present, or AVX2), the compiler's default elsewhere."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags:
        flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
        flags += ["-mavx512bf16"] if "avx512_bf16" in cpu_flags else []
        return flags + (["-mavx512vbmi"] if "avx512vbmi" in cpu_flags else [])  # int8 weights' lookups
    if {"avx2", "fma", "f16c"} <= cpu_flags:
        return ["-mavx2", "-mfma", "-mf16c"]
    return []


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled module (its import registers the `specdec_cpu` operators), or None
    (logged once) where it cannot be built here."""
    from torch.utils import cpp_extension

    flags = ["-O3", "-fopenmp", *_vector_flags()]
    text = "".join(source.read_text() for source in SOURCES + HEADERS) + " ".join(flags)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    try:
        module = cpp_extension.load(name=f"specdec_cpu_{digest}", sources=[str(s) for s in SOURCES],
                                    extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # a missing compiler or ninja, or a failed build
        logger.warning("specdec's C++ CPU kernels could not be built here (%s: %s); "
                       "using the plain-torch paths", type(error).__name__, error)
        return None
    _register_fakes()
    return module


@functools.cache
def _register_fakes() -> None:
    """Shapes for tracing (torch.compile): the operator's output is `[rows, out]`."""

    @torch.library.register_fake("specdec_cpu::linear")
    def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
          scales: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)


def linear_supports(dtype: torch.dtype, int8_weights: bool = False) -> bool:
    """Whether `torch.ops.specdec_cpu.linear` has a kernel for rows of `dtype` on this machine
    (its build needs AVX-512; bf16 also AVX512-BF16; int8 weights also AVX512-VBMI).
    Builds the extension on first use."""
    if load_extension() is None:
        return False
    return bool(torch.ops.specdec_cpu.linear_supports(dtype, int8_weights))
