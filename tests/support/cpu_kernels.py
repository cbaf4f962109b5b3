"""Whether specdec's C++ CPU kernels must be built for this test run, and what is missing.

Their tests skip where the kernels cannot be built (no compiler, as in the slim image), so a
suite can pass on any machine. On CI that would also hide a broken build: every kernel test
skipped and the run green. With `SPECDEC_REQUIRE_CPU_KERNELS=1` (`.ci/run` sets it) and a C++
compiler on the machine (or prebuilt kernels named by `SPECDEC_CPU_KERNELS_DIR`),
tests/conftest.py loads the extension before collecting anything and stops the run as failed
when it did not load, or when it lacks a linear kernel this CPU's instruction sets allow.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch

from specdec.layers import cpu_extension

REQUIRE_ENV = "SPECDEC_REQUIRE_CPU_KERNELS"


def compiler() -> str | None:
    """The C++ compiler torch's extension loader would call (`$CXX`, else `c++`), if any."""
    return shutil.which(os.environ.get("CXX") or "c++")


def required_because() -> str | None:
    """Why the kernels must load in this run, or None where a skip is legitimate."""
    if os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("1", "true", "yes"):
        return None
    prebuilt = os.environ.get(cpu_extension.PREBUILT_ENV)
    if prebuilt:
        return f"{REQUIRE_ENV} is set and {cpu_extension.PREBUILT_ENV}={prebuilt}"
    found = compiler()
    if found is None:
        return None  # nothing to build them with: their tests skip, as on the slim image
    return f"{REQUIRE_ENV} is set and a C++ compiler is here ({found})"


def cpu_flags() -> set[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return set()  # the linear kernels are x86-64's; the attention kernel builds anywhere
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def expected_linear_kernels(flags: set[str] | None = None) -> dict[str, tuple[torch.dtype, bool]]:
    """The linear kernels a CPU with these /proc/cpuinfo flags (default: this one's) must
    get: name -> (row dtype, int8 weights). Read from the CPU, not from the extension's own
    choice of build flags, so a wrong choice there shows up here too."""
    flags = cpu_flags() if flags is None else flags
    expected: dict[str, tuple[torch.dtype, bool]] = {}
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        expected["fp32 linear (AVX-512)"] = (torch.float32, False)
        if "avx512_bf16" in flags:
            expected["bf16 linear (AVX512-BF16)"] = (torch.bfloat16, False)
        if "avx512vbmi" in flags:
            expected["int8-weight linear (AVX512-VBMI)"] = (torch.float32, True)
        if {"avx512_bf16", "avx512vbmi"} <= flags:
            expected["int8-weight bf16 linear"] = (torch.bfloat16, True)
    return expected


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def missing() -> list[str]:
    """What is missing from the extension (building it if it is not cached): empty when every
    kernel this machine can run is there."""
    collect = _Collect()
    cpu_logger = logging.getLogger(cpu_extension.__name__)
    cpu_logger.addHandler(collect)
    try:
        built = cpu_extension.load_extension() is not None
    finally:
        cpu_logger.removeHandler(collect)
    if not built:
        why = "; ".join(collect.messages) or "see the log"
        return [f"the extension did not load ({why})"]
    return [f"no {name} in the build" for name, (dtype, int8_weights) in expected_linear_kernels().items()
            if not cpu_extension.linear_supports(dtype, int8_weights=int8_weights)]


def extension_or_skip() -> ModuleType:
    """The extension, for a test that needs it; a skip where it cannot be had here (never in
    a run that requires it: that stops at the start instead)."""
    module = cpu_extension.load_extension()
    if module is None:
        pytest.skip("specdec's C++ CPU kernels cannot be built here")
    return module
