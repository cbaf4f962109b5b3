"""Which build of the C++ CPU kernels a process loads, and that a prebuilt one is never compiled."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

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
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: compiled.append(kwargs))
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


def test_each_checkout_builds_in_a_folder_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Two checkouts of the same sources share the module's name but must not share a build
    # folder: each would rewrite the other's build.ninja and rebuild in turn.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = cpu_extension.build_directory("specdec_cpu_x")
    monkeypatch.setattr(cpu_extension, "CSRC", tmp_path / "other-checkout" / "csrc")
    there = cpu_extension.build_directory("specdec_cpu_x")
    assert here != there
    assert here.parent == there.parent == tmp_path / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    assert here.name.startswith("specdec_cpu_x-") and there.name.startswith("specdec_cpu_x-")


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
