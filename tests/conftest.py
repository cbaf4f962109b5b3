"""Shared test options, fixtures and the tier markers.

A test's tier is the folder it sits in: tests/unit (in-process, no socket, no child process,
no real model), tests/service (servers on port 0, child processes, fake or tiny models) and
tests/stack (the launched stack or the real default model). Each test gets its tier's marker
(`-m unit`, `-m "not stack"`) from that folder; a file left directly in tests/ counts as
service, so it never slows the unit tier down until it is moved where it belongs.

`pytest --device cuda` (or npu) runs the model tests on an accelerator; the default is cpu.
With `SPECDEC_REQUIRE_CPU_KERNELS=1` (CI) a C++ CPU kernel build that fails is a failed run,
not a run of skipped kernel tests (tests/support/cpu_kernels.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import cpu_kernels
# The shared fixtures, visible to every test from here.
from tests.support.fixtures import base_url, client, default_tokenizer, tokenizer  # noqa: F401

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "service", "stack")
# Where a file outside the tier folders counts: not unit, whose promise is no socket.
DEFAULT_TIER = "service"


def tier_of(path: Path) -> str:
    """The tier of a test file: its first folder under tests/ if that is a tier."""
    path = path.resolve()
    parts = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else DEFAULT_TIER


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item.path))


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
