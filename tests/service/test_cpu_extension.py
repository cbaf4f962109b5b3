"""Which build of the C++ CPU kernels a process loads, and that a prebuilt one is never compiled."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.layers import cpu_extension
from specdec.layers.cpu_extension import (
    PREBUILT_ENV,
    VARIANTS,
    build_name,
    load_extension,
    supported_variants,
)

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}


@pytest.mark.parametrize("cpu_flags, best", [
    (AVX512 | {"avx512_bf16", "avx512vbmi"}, "avx512-bf16-vbmi"),  # Sapphire Rapids, Zen 4
    (AVX512 | {"avx512vbmi"}, "avx512-vbmi"),                      # Ice Lake
    (AVX512 | {"avx512_bf16"}, "avx512-bf16"),                     # Cooper Lake
    (AVX512, "avx512"),                                            # Skylake-SP, Cascade Lake
    ({"avx2", "fma", "f16c"}, "avx2"),
    ({"sse4_2"}, "generic"),
])
def test_each_cpu_takes_its_best_variant_and_can_fall_back(monkeypatch: pytest.MonkeyPatch, cpu_flags: set[str],
                                                            best: str) -> None:
    monkeypatch.setattr(cpu_extension, "_is_x86", lambda: True)
    names = [variant.name for variant in supported_variants(cpu_flags)]
    assert names[0] == best
    # Every weaker build stays usable on it, down to the compiler's default one.
    assert names[-1] == "generic" and names == [v.name for v in VARIANTS if v.name in names]


def test_other_architectures_take_the_generic_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_extension, "_is_x86", lambda: False)
    assert [v.name for v in supported_variants(AVX512)] == ["generic"]
    assert [v.name for v in cpu_extension._variants_named("all")] == ["generic"]


def test_variants_are_named_distinctly() -> None:
    assert len({build_name(variant) for variant in VARIANTS}) == len(VARIANTS)
    with pytest.raises(SystemExit, match="unknown variant"):
        cpu_extension._variants_named("avx512,avx9000")


def test_a_prebuilt_dir_without_a_build_for_this_cpu_compiles_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    compiled: list[object] = []
    monkeypatch.setattr(cpu_extension, "_compile", lambda *args: compiled.append(args))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv(PREBUILT_ENV, str(tmp_path))
    load_extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
            assert load_extension() is None
    finally:
        load_extension.cache_clear()
    assert compiled == []
    assert "holds no build of these sources for this CPU" in caplog.text


def test_a_prebuilt_build_is_imported_not_compiled(tmp_path: Path) -> None:
    native = load_extension()  # built (or cached) here, as a native start does
    if native is None or native.__file__ is None:
        pytest.skip("the C++ kernels cannot be built on this machine")
    prebuilt = tmp_path / "kernels"
    prebuilt.mkdir()
    shutil.copy2(native.__file__, prebuilt / Path(native.__file__).name)
    # A fresh process (the operators register once per process) whose extension cache is
    # empty: a compile would land there and load from there.
    script = ("import logging, torch; logging.basicConfig(level=logging.INFO);"
              "from specdec.layers.cpu_extension import load_extension;"
              "print('FILE', load_extension().__file__);"
              "print('OPS', hasattr(torch.ops.specdec_cpu, 'linear'))")
    env = {**os.environ, PREBUILT_ENV: str(prebuilt), "TORCH_EXTENSIONS_DIR": str(tmp_path / "jit")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    assert f"FILE {prebuilt / Path(native.__file__).name}" in result.stdout
    assert "OPS True" in result.stdout
    assert f"variant {supported_variants()[0].name}, prebuilt" in result.stderr
    assert not (tmp_path / "jit").exists()


def test_another_checkout_of_the_same_sources_loads_the_machines_build(tmp_path: Path) -> None:
    native = load_extension()
    if native is None or native.__file__ is None:
        pytest.skip("the C++ kernels cannot be built on this machine")
    # A fresh cache holding this checkout's build, and a second checkout of the same
    # sources elsewhere (its csrc copied): it must load that build and compile nothing.
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    env.pop(PREBUILT_ENV, None)
    cache = Path(subprocess.run(
        [sys.executable, "-c", "from specdec.layers.cpu_extension import machine_cache_dir;"
                               "print(machine_cache_dir())"],
        env=env, capture_output=True, text=True, check=True).stdout.strip())
    cache.mkdir(parents=True)
    shutil.copy2(native.__file__, cache / Path(native.__file__).name)
    other_csrc = tmp_path / "other-checkout" / "csrc"
    shutil.copytree(cpu_extension.CSRC, other_csrc)
    script = ("import logging, sys; from pathlib import Path; logging.basicConfig(level=logging.INFO);"
              "from specdec.layers import cpu_extension as ext;"
              f"ext.CSRC = Path({str(other_csrc)!r});"
              "ext.SOURCES = tuple(ext.CSRC / s.name for s in ext.SOURCES);"
              "ext.HEADERS = tuple(ext.CSRC / h.name for h in ext.HEADERS);"
              "ext._compile = lambda *a: sys.exit('compiled again');"
              "print('FILE', ext.load_extension().__file__)")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"FILE {cache / Path(native.__file__).name}" in result.stdout


def test_a_build_says_what_it_does_and_lands_in_the_cache_whole(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    variant = supported_variants()[0]
    library = tmp_path / f"{build_name(variant)}.so"

    def compile_in(variant: object, build_dir: Path) -> Path:
        assert (build_dir / "lock").exists()  # held while compiling
        built = build_dir / library.name
        built.write_bytes(b"library")
        return built

    monkeypatch.setattr(cpu_extension, "_compile", compile_in)
    with caplog.at_level(logging.INFO, logger=cpu_extension.__name__):
        cpu_extension._build_into_cache(variant, library)
    assert library.read_bytes() == b"library"
    assert not (library.with_suffix(".build") / "lock").exists()
    started, ended = [r.getMessage() for r in caplog.records]
    assert started.startswith(f"compiling specdec's C++ CPU kernels (variant {variant.name})")
    assert "once per machine" in started and "minutes" in started and str(tmp_path) in started
    assert ended.startswith("compiled specdec's C++ CPU kernels in") and str(library) in ended


def test_the_lock_of_a_builder_that_is_gone_is_taken_over_at_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock = tmp_path / "lock"
    lock.write_text(f"{socket.gethostname()} {gone.pid}")
    monkeypatch.setattr(cpu_extension.time, "sleep", lambda s: pytest.fail("waited for a dead builder"))
    cpu_extension._clear_stale_lock(lock)
    assert not lock.exists()
    # A live builder's lock (this process) is waited for.
    lock.write_text(f"{socket.gethostname()} {os.getpid()}")
    sleeps = []
    monkeypatch.setattr(cpu_extension.time, "sleep", lambda s: sleeps.append(s) or lock.unlink())
    cpu_extension._clear_stale_lock(lock)
    assert sleeps == [1.0]


def test_a_dead_builders_lock_is_removed_and_a_live_one_waited_for(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    old = lock.stat().st_mtime - cpu_extension.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        cpu_extension._clear_stale_lock(lock)
    assert not lock.exists()
    assert "stale" in caplog.text

    # A lock with recent work beside it belongs to a live build: wait until it goes away.
    lock.touch()
    sleeps = []

    def builder_finishes(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            lock.unlink()

    monkeypatch.setattr(cpu_extension.time, "sleep", builder_finishes)
    cpu_extension._clear_stale_lock(lock)
    assert len(sleeps) == 3 and not lock.exists()
