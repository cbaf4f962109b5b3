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
the other's binary). Where they cannot be built (no compiler) `load_extension` says why once
and callers keep the plain-torch paths.

*Prebuilt kernels* (the container image): `python -m specdec.layers.cpu_extension prebuild DIR`
compiles one build per instruction-set variant (`VARIANTS`) on a machine with a compiler,
without importing any of them (the build machine need not run them). A process started with
`SPECDEC_CPU_KERNELS_DIR=DIR` then compiles nothing: it imports the best variant in DIR that
the CPU it runs on supports, by the same choice and the same name as a native build (so an
image built on one CPU runs the fast path on another), and where DIR holds none for this CPU
or these sources it logs why and keeps the plain-torch paths.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_attention_cpu.cpp", "linear_cpu.cpp", "decoder_cpu.cpp"))
HEADERS = (CSRC / "cpu_kernels.h",)
PREBUILT_ENV = "SPECDEC_CPU_KERNELS_DIR"
# A build lock this long untouched (nor anything beside it) was left by a dead builder;
# one object file took at most ~35 s here on 2 loaded cores.
STALE_LOCK_S = 180.0
BASE_FLAGS = ("-O3", "-fopenmp")


@dataclass(frozen=True)
class Variant:
    """One build: the /proc/cpuinfo flags a CPU needs to run it, the compiler flags it uses."""

    name: str
    cpu_flags: frozenset[str]
    cflags: tuple[str, ...]


_AVX512_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c")
# Best first: a CPU takes the first it supports. AVX-512 with its BF16 dot products and VBMI
# (the int8 weights' lookups) where present, else AVX2, else the compiler's default.
VARIANTS = (
    Variant("avx512-bf16-vbmi", _AVX512_CPU | {"avx512_bf16", "avx512vbmi"},
            _AVX512 + ("-mavx512bf16", "-mavx512vbmi")),
    Variant("avx512-bf16", _AVX512_CPU | {"avx512_bf16"}, _AVX512 + ("-mavx512bf16",)),
    Variant("avx512-vbmi", _AVX512_CPU | {"avx512vbmi"}, _AVX512 + ("-mavx512vbmi",)),
    Variant("avx512", _AVX512_CPU, _AVX512),
    Variant("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    Variant("generic", frozenset(), ()),
)


def _is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def supported_variants(cpu_flags: set[str] | None = None) -> list[Variant]:
    """The variants this machine (or a CPU with `cpu_flags`) runs, best first; on other
    architectures than x86-64 only `generic`."""
    if not _is_x86():
        return [VARIANTS[-1]]
    if cpu_flags is None:
        try:
            cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
        except OSError:
            cpu_flags = set()
    return [variant for variant in VARIANTS if variant.cpu_flags <= cpu_flags]


def build_name(variant: Variant) -> str:
    """The module's name: the sources and the flags hashed, so a changed source or another
    variant never reuses a build."""
    flags = [*BASE_FLAGS, *variant.cflags]
    text = "".join(source.read_text() for source in SOURCES + HEADERS) + " ".join(flags)
    return f"specdec_cpu_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled module (its import registers the `specdec_cpu` operators), or None
    (logged once) where it cannot be had here: from `$SPECDEC_CPU_KERNELS_DIR` when set
    (never compiling), else built on first use."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    module = _load_prebuilt(Path(prebuilt)) if prebuilt else _build_and_load()
    if module is not None:
        _register_fakes()
    return module


def _build_and_load() -> ModuleType | None:
    from torch.utils import cpp_extension

    variant = supported_variants()[0]
    flags = [*BASE_FLAGS, *variant.cflags]
    name = build_name(variant)
    build_dir = build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir / "lock")
    try:
        module = cpp_extension.load(name=name, sources=[str(s) for s in SOURCES],
                                    extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                    build_directory=str(build_dir), verbose=False)
    except Exception as error:  # a missing compiler or ninja, or a failed build
        logger.warning("specdec's C++ CPU kernels could not be built here (%s: %s); "
                       "using the plain-torch paths", type(error).__name__, error)
        return None
    logger.info("specdec's C++ CPU kernels: variant %s, built on this machine (or its cache)", variant.name)
    return module


def build_directory(name: str) -> Path:
    """Where this checkout builds `name`: under `$TORCH_EXTENSIONS_DIR` (default
    `~/.cache/torch_extensions`), one directory per source folder. Two checkouts of the same
    sources (a CI clone beside a work tree) share the module name but not the folder, since
    each would otherwise rewrite the other's build file and rebuild in turn."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    checkout = hashlib.sha256(str(CSRC.resolve()).encode()).hexdigest()[:8]
    return root / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / f"{name}-{checkout}"


def _clear_stale_lock(lock: Path) -> None:
    """Waits out another process's build, and removes the lock of one that died.

    torch waits for a lock to go away and never asks whether its holder lives, so a process
    killed mid-build (a SIGKILLed server child) would hang every later start. A live build
    writes into its folder at least every minute or so (one object file each); a lock with
    nothing newer beside it for STALE_LOCK_S was left by a dead builder."""
    while lock.exists():
        try:
            newest = max(entry.stat().st_mtime for entry in lock.parent.iterdir())
        except (OSError, ValueError):  # the lock went away meanwhile
            continue
        idle_s = time.time() - newest
        if idle_s >= STALE_LOCK_S:
            logger.warning("removing a stale C++ kernel build lock %s (nothing built for %.0f s)",
                           lock, idle_s)
            lock.unlink(missing_ok=True)
            return
        time.sleep(1.0)


def _load_prebuilt(directory: Path) -> ModuleType | None:
    variants = supported_variants()
    for variant in variants:
        name = build_name(variant)
        path = directory / f"{name}.so"
        if not path.is_file():
            continue
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"not an extension module: {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (ImportError, OSError) as error:  # e.g. a runtime library missing from the image
            logger.warning("specdec's prebuilt C++ CPU kernels %s could not be loaded (%s: %s); "
                           "using the plain-torch paths", path, type(error).__name__, error)
            return None
        logger.info("specdec's C++ CPU kernels: variant %s, prebuilt", variant.name)
        return module
    logger.warning("specdec's C++ CPU kernels: %s=%s holds no build of these sources for this "
                   "CPU (it runs %s); using the plain-torch paths, nothing is compiled",
                   PREBUILT_ENV, directory, ", ".join(v.name for v in variants))
    return None


def prebuild(directory: Path, variants: list[Variant]) -> list[Path]:
    """Compile each of `variants` into `directory/<build_name>.so` without importing it."""
    # torch's loader builds and imports in one call; this is its build half (the same ninja
    # file, flags and compiler, so the result equals a native build). Private, so its
    # signature is torch 2.13's: torch is pinned, and a change fails the image build loudly.
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library

    directory.mkdir(parents=True, exist_ok=True)
    built = []
    for variant in variants:
        name = build_name(variant)
        with tempfile.TemporaryDirectory(prefix=f"{name}-") as build_dir:
            _write_ninja_file_and_build_library(
                name=name, sources=[str(s) for s in SOURCES], extra_cflags=[*BASE_FLAGS, *variant.cflags],
                extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=["-fopenmp"],
                extra_include_paths=[], build_directory=build_dir, verbose=False, with_cuda=False,
                with_sycl=False)
            shutil.copy2(Path(build_dir) / f"{name}.so", directory / f"{name}.so")
        logger.info("built variant %s: %s", variant.name, directory / f"{name}.so")
        built.append(directory / f"{name}.so")
    return built


def _variants_named(spec: str) -> list[Variant]:
    """`all` (every variant this architecture can compile), `native` (this CPU's best) or
    names separated by commas."""
    if spec == "all":
        return list(VARIANTS) if _is_x86() else [VARIANTS[-1]]
    if spec == "native":
        return supported_variants()[:1]
    by_name = {variant.name: variant for variant in VARIANTS}
    unknown = [name for name in spec.split(",") if name.strip() not in by_name]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: all, native, {', '.join(by_name)}")
    return [by_name[name.strip()] for name in spec.split(",")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.layers.cpu_extension",
                                     description="Compile the C++ CPU kernels ahead of time.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("prebuild", help=f"compile variants into DIR (then set {PREBUILT_ENV}=DIR)")
    build.add_argument("directory", type=Path)
    build.add_argument("--variants", default="all", help="all, native, or names separated by commas: "
                       + ", ".join(v.name for v in VARIANTS))
    listing = sub.add_parser("list", help="the variants in DIR built from these sources (exit 1: none)")
    listing.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "prebuild":
        prebuild(args.directory, _variants_named(args.variants))
        return
    present = [v.name for v in VARIANTS if (args.directory / f"{build_name(v)}.so").is_file()]
    runs_here = [v.name for v in supported_variants()]
    print(f"{args.directory}: {', '.join(present) or 'no build of these sources'}; "
          f"this CPU runs {', '.join(runs_here)}")
    if not present:
        raise SystemExit(1)


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


if __name__ == "__main__":
    main(sys.argv[1:])
