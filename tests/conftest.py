"""Shared test options and fixtures.

`pytest --device cuda` (or npu) runs the model tests on an accelerator; the default is cpu.
With `SPECDEC_REQUIRE_CPU_KERNELS=1` (CI) a C++ CPU kernel build that fails is a failed run,
not a run of skipped kernel tests (tests/support/cpu_kernels.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import cpu_kernels


def pytest_report_header(config: pytest.Config) -> str:
    because = cpu_kernels.required_because()
    if because is None:
        return "specdec C++ CPU kernels: optional here (their tests skip where they cannot be built)"
    expected = ", ".join(cpu_kernels.expected_linear_kernels()) or "no linear kernel on this CPU"
    return f"specdec C++ CPU kernels: required ({because}): attention, {expected}"


def pytest_sessionstart(session: pytest.Session) -> None:
    # Before collection, whose skipif marks would otherwise skip every kernel test quietly.
    because = cpu_kernels.required_because()
    if because is None:
        return
    problems = cpu_kernels.missing()
    if problems:
        pytest.exit(f"specdec's C++ CPU kernels are required ({because}) but {'; '.join(problems)}. "
                    f"Their tests would all be skipped: fix the build, or unset "
                    f"{cpu_kernels.REQUIRE_ENV} where these kernels are not expected.",
                    returncode=pytest.ExitCode.TESTS_FAILED)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", help="torch device for model tests: cpu, cuda or npu")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    name = request.config.getoption("--device")
    if name == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)
    return torch.device(name)
