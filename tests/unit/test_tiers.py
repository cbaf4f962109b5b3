"""The unit tier keeps its promise: no socket, no child process, no real model.

tests/conftest.py marks each test from its folder; this reads every unit test file for the
imports and fixtures that would break the promise, so a test that starts a server or loads
the default model is moved to tests/service or tests/stack instead of slowing the loop that
runs on every change.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent
# Modules whose import means a socket, a child process or a server.
FORBIDDEN_MODULES = {
    "subprocess", "socket", "multiprocessing", "uvicorn", "http.server", "grpc",
    "tests.support.served_stack", "tests.support.stack_processes",
    "tests.support.verifier_harness", "tests.support.engine_harness",
    "tests.support.model_drafting",
    # A command run in-process starts what it starts (bench commands: a drafter server).
    "specdec.__main__",
}
# Names that start a server, find a port or load the real default model.
FORBIDDEN_NAMES = {
    "start_drafter_server", "start_verifier", "serve", "live_gateway", "LiveGateway",
    "FakeVerifierServer", "free_port", "DEFAULT_MODEL", "start_http_server",
}
# Shared fixtures (tests/support/fixtures.py) that start a gateway or load the real model.
FORBIDDEN_FIXTURES = {"base_url", "client", "default_tokenizer"}


def breaches(source: str) -> list[str]:
    """What in a unit test file's source would start a socket, a process or the real model."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names
                      if alias.name.split(".")[0] in FORBIDDEN_MODULES or alias.name in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module in FORBIDDEN_MODULES or module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(module)
            found += [alias.name for alias in node.names if alias.name in FORBIDDEN_NAMES]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found += [arg.arg for arg in node.args.args if arg.arg in FORBIDDEN_FIXTURES]
    return found


@pytest.mark.parametrize("path", sorted(UNIT.glob("test_*.py")), ids=lambda path: path.name)
def test_a_unit_test_file_starts_nothing(path: Path) -> None:
    assert breaches(path.read_text("utf-8")) == [], f"{path.name} belongs in tests/service or tests/stack"


def test_the_check_sees_servers_processes_and_the_real_model() -> None:
    source = ("import subprocess\nfrom grpc import aio\n"
              "from tests.support.fake_verifier import LiveGateway, build_tiny_tokenizer\n"
              "from specdec.models.model_files import DEFAULT_MODEL\n"
              "def test_x(client, tokenizer): pass\n")
    assert breaches(source) == ["subprocess", "grpc", "LiveGateway", "DEFAULT_MODEL", "client"]
    assert breaches("from tests.support.fake_verifier import build_tiny_tokenizer\n") == []


def test_tests_are_marked_with_their_folders_tier(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("service") is None
    assert request.node.get_closest_marker("stack") is None
