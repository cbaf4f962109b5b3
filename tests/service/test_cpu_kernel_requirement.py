"""CI's gate on the C++ CPU kernels (tests/support/cpu_kernels.py, tests/conftest.py): a run that
requires them fails at its start where they did not build, instead of skipping their tests."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.layers import cpu_extension
from tests.support import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
ALL_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi"}


def test_required_only_when_asked_and_buildable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_extension.PREBUILT_ENV, raising=False)
    monkeypatch.setenv("CXX", sys.executable)  # any file that exists stands for a compiler
    monkeypatch.delenv(cpu_kernels.REQUIRE_ENV, raising=False)
    assert cpu_kernels.required_because() is None
    monkeypatch.setenv(cpu_kernels.REQUIRE_ENV, "1")
    assert sys.executable in cpu_kernels.required_because()
    monkeypatch.setenv("CXX", "/no/such/compiler")  # as on the slim image: the tests skip
    assert cpu_kernels.required_because() is None
    monkeypatch.setenv(cpu_extension.PREBUILT_ENV, "/opt/kernels")  # nothing to compile
    assert "/opt/kernels" in cpu_kernels.required_because()


def test_expected_kernels_follow_the_cpu() -> None:
    assert cpu_kernels.expected_linear_kernels(set()) == {}
    assert cpu_kernels.expected_linear_kernels({"avx2", "fma", "f16c"}) == {}
    assert list(cpu_kernels.expected_linear_kernels(ALL_FLAGS - {"avx512_bf16", "avx512vbmi"}).values()) == [
        (torch.float32, False)]
    assert sorted(map(str, cpu_kernels.expected_linear_kernels(ALL_FLAGS).values())) == sorted(map(str, [
        (torch.float32, False), (torch.bfloat16, False), (torch.float32, True), (torch.bfloat16, True)]))


def test_a_failed_build_is_reported_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def failed_build() -> None:
        logging.getLogger(cpu_extension.__name__).warning("could not be built (g++ exited with 1)")
        return None

    monkeypatch.setattr(cpu_extension, "load_extension", failed_build)
    assert cpu_kernels.missing() == ["the extension did not load (could not be built (g++ exited with 1))"]


def test_a_kernel_missing_from_the_build_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: set(ALL_FLAGS))
    monkeypatch.setattr(cpu_extension, "load_extension", lambda: object())
    monkeypatch.setattr(cpu_extension, "linear_supports",
                        lambda dtype, int8_weights=False: dtype == torch.float32)
    assert cpu_kernels.missing() == ["no bf16 linear (AVX512-BF16) in the build",
                                     "no int8-weight bf16 linear in the build"]
    monkeypatch.setattr(cpu_extension, "linear_supports", lambda dtype, int8_weights=False: True)
    assert cpu_kernels.missing() == []


def test_a_required_run_stops_at_its_start_when_the_build_fails(tmp_path: Path) -> None:
    """The whole gate: conftest's check, in a pytest run of its own whose build fails."""
    (tmp_path / "broken_build.py").write_text(
        "from specdec.layers import cpu_extension\n\n\n"
        "def pytest_configure(config):\n"
        "    def broken(*args, **kwargs):\n"
        "        raise RuntimeError('simulated: g++ exited with status 1')\n"
        "    cpu_extension._compile = broken\n")
    env = {key: value for key, value in os.environ.items() if key != cpu_extension.PREBUILT_ENV}
    # An empty kernel cache: this machine's holds a build the loader would import.
    env.update({cpu_kernels.REQUIRE_ENV: "1", "CXX": sys.executable,
                "TORCH_EXTENSIONS_DIR": str(tmp_path / "kernel-cache"),
                "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "broken_build",
                          "tests/service/test_cpu_kernel_requirement.py::test_expected_kernels_follow_the_cpu"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = run.stdout + run.stderr
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "C++ CPU kernels are required" in output and "simulated: g++ exited with status 1" in output
    assert "passed" not in output  # stopped before running anything
