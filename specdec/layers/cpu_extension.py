"""specdec's C++ kernels for the CPU, built once per machine into one extension module.

- `csrc/paged_attention_cpu.cpp`: paged attention in one call per layer (`attention_cpu`).
- `csrc/linear_cpu.cpp`: the linear `torch.ops.specdec_cpu.linear` on a weight packed by
  `torch.ops.specdec_cpu.pack_weight` (or, weight-only int8 with a scale per output column,
  `pack_weight_int8`), torch operators (so a compiled graph calls it without Python in
  between), used by `PackedLinear`'s `cpu` and `int8` kernels.
- `csrc/decoder_cpu.cpp`: every decoder layer of a Llama-family model in one call, built on
  the two above (`specdec.models.cpu_stack`). `csrc/cpu_kernels.h` declares what the files
  share.

They are built with torch's C++ extension toolchain (g++ and ninja) once per machine, into
`machine_cache_dir()` (under `TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`),
named by a hash of the sources and the instruction-set flags: every checkout of the same
sources on the machine loads the same library, and a cache shared by two machines never hands
one the other's binary. A build logs when it starts and ends. Where they cannot be built (no
compiler) `load_extension` says why once and callers keep the plain-torch paths.

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

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_attention_cpu.cpp", "linear_cpu.cpp", "gguf_linear_cpu.cpp",
                                          "decoder_cpu.cpp"))
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
    variant = supported_variants()[0]
    name = build_name(variant)
    library = machine_cache_dir() / f"{name}.so"
    try:
        if not library.is_file():
            _build_into_cache(variant, library)
        module = _import_library(name, library)
    except Exception as error:  # a missing compiler or ninja, a failed build or import
        logger.warning("specdec's C++ CPU kernels could not be built here (%s: %s); "
                       "using the plain-torch paths", type(error).__name__, error)
        return None
    logger.info("specdec's C++ CPU kernels: variant %s, from this machine's cache %s",
                variant.name, library.parent)
    return module


def machine_cache_dir() -> Path:
    """Where built kernels are kept for every checkout on this machine: under
    `$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), one folder per Python and
    torch version (the module's ABI); inside, one `<build_name>.so` per sources and variant.
    Nothing in it depends on where a checkout lives."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    python = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    return root / python / f"specdec-torch{torch.__version__.split('+')[0]}"


def is_cached() -> bool:
    """Whether this machine already holds a build of these sources for its CPU (a start
    then loads it in a second; otherwise `load_extension` compiles it first)."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        return True  # a prebuilt directory is never compiled into
    return (machine_cache_dir() / f"{build_name(supported_variants()[0])}.so").is_file()


def _build_into_cache(variant: Variant, library: Path) -> None:
    """Compiles `variant` into `library`, once per machine: a process that finds another
    one's build under way waits for it and compiles nothing."""
    build_dir = library.with_suffix(".build")
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir / "lock"):
        if library.is_file():
            return  # built by the process this one waited for
        logger.info("compiling specdec's C++ CPU kernels (variant %s): once per machine and "
                    "kernel version, about 1.5 CPU-minutes (a minute or two on an idle machine, "
                    "more on a busy one); the plain-torch paths would be several times "
                    "slower. Cached in %s",
                    variant.name, library.parent)
        started = time.monotonic()
        built = _compile(variant, build_dir)
        # Another checkout's start sees the library whole or not at all.
        partial = library.with_name(f".{library.name}.{os.getpid()}")
        shutil.copy2(built, partial)
        os.replace(partial, library)
        logger.info("compiled specdec's C++ CPU kernels in %.0f s: %s",
                    time.monotonic() - started, library)


@contextlib.contextmanager
def _build_lock(lock: Path) -> Iterator[None]:
    """Held by one builder per build folder; a dead builder's lock is taken over."""
    while True:
        if lock.exists():
            logger.info("another process is compiling specdec's C++ CPU kernels (%s); waiting "
                        "for it", lock.parent)
        _clear_stale_lock(lock)
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue  # another waiter took it first
        with os.fdopen(descriptor, "w") as owner:
            owner.write(f"{socket.gethostname()} {os.getpid()}")
        break
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _compile(variant: Variant, build_dir: Path) -> Path:
    """Compiles `variant` in `build_dir` without importing it; returns the library."""
    # torch's loader builds and imports in one call, and keys its build on the folder and
    # the ninja file, whose paths (sources, torch's headers) differ per checkout and venv;
    # this is its build half alone (the same ninja file, flags and compiler). Private, so
    # its signature is torch 2.13's: torch is pinned, and a change fails the image build
    # and the kernel tests loudly.
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library

    name = build_name(variant)
    _write_ninja_file_and_build_library(
        name=name, sources=[str(s) for s in SOURCES], extra_cflags=[*BASE_FLAGS, *variant.cflags],
        extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=["-fopenmp"],
        extra_include_paths=[], build_directory=str(build_dir), verbose=False, with_cuda=False,
        with_sycl=False)
    return build_dir / f"{name}.so"


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not an extension module: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clear_stale_lock(lock: Path) -> None:
    """Waits out another process's build, and removes the lock of one that died.

    A process stopped or killed mid-build leaves its lock behind. The lock names its
    builder's host and pid: a builder on this host that is gone left it. Where that cannot
    be told (another host sharing the cache), a live build writes into its folder at least
    every minute or so (one object file each), so a lock with nothing newer beside it for
    STALE_LOCK_S was left by a dead builder."""
    while lock.exists():
        try:
            newest = max(entry.stat().st_mtime for entry in lock.parent.iterdir())
            owner = lock.read_text().split()
        except (OSError, ValueError):  # the lock went away meanwhile
            continue
        idle_s = time.time() - newest
        if _owner_is_gone(owner) or idle_s >= STALE_LOCK_S:
            logger.warning("removing a stale C++ kernel build lock %s (its builder is gone)", lock)
            lock.unlink(missing_ok=True)
            return
        time.sleep(1.0)


def _owner_is_gone(owner: list[str]) -> bool:
    """Whether a lock's `host pid` names a process of this host that no longer runs."""
    if len(owner) != 2 or owner[0] != socket.gethostname() or not owner[1].isdigit():
        return False
    try:
        os.kill(int(owner[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        pass
    return False


def _load_prebuilt(directory: Path) -> ModuleType | None:
    variants = supported_variants()
    for variant in variants:
        name = build_name(variant)
        path = directory / f"{name}.so"
        if not path.is_file():
            continue
        try:
            module = _import_library(name, path)
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
    directory.mkdir(parents=True, exist_ok=True)
    built = []
    for variant in variants:
        name = build_name(variant)
        with tempfile.TemporaryDirectory(prefix=f"{name}-") as build_dir:
            shutil.copy2(_compile(variant, Path(build_dir)), directory / f"{name}.so")
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
    # Not specdec.cli's formatter: the image's kernel stage holds this module alone.
    parser = argparse.ArgumentParser(prog="python -m specdec.layers.cpu_extension",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="Compile the C++ CPU kernels ahead of time.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("prebuild", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           help=f"compile variants into DIR (then set {PREBUILT_ENV}=DIR)")
    build.add_argument("directory", type=Path)
    build.add_argument("--variants", default="all", help="all, native, or names separated by commas: "
                       + ", ".join(v.name for v in VARIANTS))
    listing = sub.add_parser("list", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                             help="the variants in DIR built from these sources (exit 1: none)")
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
