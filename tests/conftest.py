"""Shared test options and fixtures.

`pytest --device cuda` (or npu) runs the model tests on an accelerator; the default is cpu.
"""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", help="torch device for model tests: cpu, cuda or npu")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    name = request.config.getoption("--device")
    if name == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)
    return torch.device(name)
