"""Every module the code imports unconditionally is the standard library's, first-party, or
provided by a distribution pyproject.toml declares: the services' code by the runtime
dependencies, the tests by those plus the `test` extra. A package that is merely installed
on the machine (as jsonschema once was) fails here, not on a new user's fresh environment.

Imports inside functions, or guarded by `try: ... except ImportError`, are optional by
construction (matplotlib for plots, llama_cpp for comparisons, torch_npu) and not checked."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"specdec", "gateway", "verifier_svc", "drafter_svc", "tests"}
PACKAGES = ("specdec", "gateway", "verifier_svc", "drafter_svc")


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0])


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {requirement_name(item) for item in project["dependencies"]}
    test = {requirement_name(item) for item in project["optional-dependencies"]["test"]}
    return runtime, runtime | test


def with_requirements(names: set[str]) -> set[str]:
    """The declared distributions and everything they require (what pip installs for them)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [requirement_name(item) for item in requires if "extra ==" not in item]
    return seen


def unconditional_imports(path: Path) -> set[str]:
    """Top-level module names imported at module level outside `try ... except ImportError`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                guarded = any(handler.type is not None and any(
                    name in ast.unparse(handler.type) for name in ("ImportError", "ModuleNotFoundError"))
                    for handler in node.handlers)
                if not guarded:
                    visit(node.body)

    visit(tree.body)
    return names


def providers() -> dict[str, set[str]]:
    return {module: {normalize(dist) for dist in dists}
            for module, dists in importlib.metadata.packages_distributions().items()}


def undeclared(files: list[Path], allowed: set[str]) -> list[str]:
    by_module = providers()
    problems = []
    for path in files:
        siblings = {sibling.stem for sibling in path.parent.glob("*.py")}  # pytest's rootdir imports
        for module in sorted(unconditional_imports(path)):
            if module in FIRST_PARTY | siblings or module in sys.stdlib_module_names or module == "__future__":
                continue
            dists = by_module.get(module, set())
            if not dists & allowed:
                problems.append(f"{path.relative_to(ROOT)} imports {module} "
                                f"(from {sorted(dists) or 'no installed distribution'}), "
                                "which no declared dependency provides")
    return problems


def test_the_services_import_only_their_runtime_dependencies() -> None:
    runtime, _ = declared()
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 50
    assert undeclared(files, with_requirements(runtime)) == []


def test_the_tests_import_only_declared_dependencies() -> None:
    _, everything = declared()
    files = sorted((ROOT / "tests").rglob("*.py"))
    assert len(files) > 50
    assert undeclared(files, with_requirements(everything)) == []


def test_an_undeclared_import_is_reported(tmp_path: Path) -> None:
    probe = ROOT / "tests" / "_probe_undeclared.py"
    try:
        probe.write_text("import pytest\nimport some_package_nobody_declares\n"
                         "try:\n    import matplotlib\nexcept ImportError:\n    pass\n")
        problems = undeclared([probe], {"pytest"})
    finally:
        probe.unlink()
    assert len(problems) == 1 and "some_package_nobody_declares" in problems[0]


@pytest.mark.parametrize("source, expected", [
    ("import a.b\nfrom c import d\n", {"a", "c"}),
    ("def f():\n    import lazy\n", set()),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import typed_only\n", {"typing"}),
    ("try:\n    import optional\nexcept ImportError:\n    optional = None\n", set()),
    ("from . import sibling\n", set()),
])
def test_which_imports_count_as_unconditional(tmp_path: Path, source: str, expected: set[str]) -> None:
    path = tmp_path / "module.py"
    path.write_text(source)
    assert unconditional_imports(path) == expected
