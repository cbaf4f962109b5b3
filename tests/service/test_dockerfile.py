"""The image's build cannot be broken silently by a move: every path the Dockerfile copies
exists and is not left out by .dockerignore, and every module a stage runs with
`python3 -m` (and every module the compose, Swarm and Kubernetes files start) imports from
the files that stage holds. No Docker engine is needed: each stage's tree is rebuilt from
its COPY lines in a temporary folder and the modules are imported from there alone."""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("specdec", "gateway", "verifier_svc", "drafter_svc")


@dataclass
class Stage:
    name: str
    parent: str
    copies: list[tuple[list[str], str]] = field(default_factory=list)  # (sources, dest)
    modules: list[str] = field(default_factory=list)  # run as `python3 -m MODULE`


def logical_lines(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def parse_dockerfile(text: str) -> list[Stage]:
    stages: list[Stage] = []
    for line in logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            words = rest.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"stage{len(stages)}"
            stages.append(Stage(name=name, parent=words[0]))
        elif instruction == "COPY":
            words = [word for word in shlex.split(rest) if not word.startswith("--chmod")]
            if any(word.startswith("--from") for word in words):
                continue  # from another stage's output, not the build context
            words = [word for word in words if not word.startswith("--")]
            stages[-1].copies.append((words[:-1], words[-1]))
        elif instruction == "RUN":
            stages[-1].modules += re.findall(r"python3 -m ([A-Za-z_][\w.]*)", rest)
    return stages


def dockerignore_patterns() -> list[str]:
    patterns = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        # The matcher below knows no exceptions; a `!` line would make it wrong.
        assert not line.startswith("!"), f".dockerignore exception {line!r}: teach this test about it"
        patterns.append(line.rstrip("/"))
    return patterns


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves `path` (or a folder above it) out."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(Path(prefix).name, pattern[3:]):
                return True
    return False


def copy_like_docker(source: Path, dest: str, tree: Path) -> None:
    """COPY's rules for one local source: a folder's contents go into dest; a file goes to
    dest/NAME when dest ends in '/', else to dest itself."""
    target = tree / dest.lstrip("/")
    if source.is_dir():
        shutil.copytree(source, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    elif dest.endswith("/") or dest in (".", "./"):
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / source.name)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def build_tree(stage: Stage, stages: dict[str, Stage], tree: Path) -> None:
    if stage.parent in stages:
        build_tree(stages[stage.parent], stages, tree)
    for sources, dest in stage.copies:
        for source in sources:
            copy_like_docker(ROOT / source, dest, tree)


def import_from(tree: Path, module: str) -> subprocess.CompletedProcess:
    """Runs `python3 -m module --help` in `tree` and fails unless every first-party module
    it imported came from the tree (an installed checkout on the path must not stand in for
    a file the stage lacks)."""
    code = (
        "import runpy, sys\n"
        "root, name = sys.argv[1], sys.argv[2]\n"
        "sys.argv = [name, '--help']\n"
        "try:\n"
        "    runpy.run_module(name, run_name='__main__', alter_sys=True)\n"
        "except SystemExit as stop:\n"
        "    assert stop.code in (0, None), f'{name} --help exited {stop.code}'\n"
        f"first_party = {FIRST_PARTY!r}\n"
        "for loaded, module in list(sys.modules.items()):\n"
        "    origin = getattr(module, '__file__', None)\n"
        "    if loaded.split('.')[0] in first_party and origin:\n"
        "        assert origin.startswith(root), f'{loaded} came from {origin}, not the stage'\n"
    )
    return subprocess.run([sys.executable, "-c", code, str(tree), module], cwd=tree,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text())


def test_the_parser_sees_the_stages_the_image_is_made_of(stages: list[Stage]) -> None:
    names = [stage.name for stage in stages]
    assert names[:3] == ["torch", "requirements", "kernels"] and len(names) == 4
    kernels = stages[2]
    assert "specdec.layers.cpu_extension" in kernels.modules and kernels.copies


def test_every_copied_path_exists_and_is_in_the_build_context(stages: list[Stage]) -> None:
    patterns = dockerignore_patterns()
    copied = [source for stage in stages for sources, _ in stage.copies for source in sources]
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which does not exist"
        assert not ignored(source, patterns), f"the Dockerfile copies {source}, which .dockerignore leaves out"


def test_the_ignore_matcher_leaves_out_what_dockerignore_names() -> None:
    patterns = dockerignore_patterns()
    assert ignored("tests/service/test_dockerfile.py", patterns)
    assert ignored("specdec/layers/__pycache__/x.pyc", patterns)
    assert not ignored("specdec/layers/cpu_extension.py", patterns)


def test_every_module_a_stage_runs_imports_from_that_stage_alone(stages: list[Stage], tmp_path: Path) -> None:
    by_name = {stage.name: stage for stage in stages}
    checked = 0
    for stage in stages:
        first_party = [module for module in stage.modules if module.split(".")[0] in FIRST_PARTY]
        if not first_party:
            continue
        tree = tmp_path / stage.name
        tree.mkdir()
        build_tree(stage, by_name, tree)
        for module in first_party:
            result = import_from(tree, module)
            assert result.returncode == 0, f"stage {stage.name}: python3 -m {module}: {result.stderr[-2000:]}"
            checked += 1
    assert checked >= 2  # the kernels' prebuild and the final image's check


def started_modules() -> set[str]:
    """The modules the compose, Swarm and Kubernetes files start in the image."""
    modules: set[str] = set()
    files = [ROOT / "docker-compose.yml", *sorted((ROOT / "deploy").rglob("*.yml")),
             *sorted((ROOT / "deploy").rglob("*.yaml"))]
    for path in files:
        text = path.read_text()
        modules.update(re.findall(r"python3 -m ([A-Za-z_][\w.]*)", text))
        modules.update(re.findall(r'"python3",\s*"-m",\s*"([A-Za-z_][\w.]*)"', text))
    return {module for module in modules if module.split(".")[0] in FIRST_PARTY}


def test_every_service_the_deployments_start_imports_from_the_final_image(stages: list[Stage],
                                                                         tmp_path: Path) -> None:
    modules = started_modules()
    assert {"gateway", "verifier_svc", "drafter_svc"} <= modules
    by_name = {stage.name: stage for stage in stages}
    build_tree(stages[-1], by_name, tmp_path)
    for module in sorted(modules):
        result = import_from(tmp_path, module)
        assert result.returncode == 0, f"python3 -m {module} in the image: {result.stderr[-2000:]}"


def test_a_move_that_breaks_the_kernels_stage_is_caught(tmp_path: Path) -> None:
    """The check fails on the mistake it exists for: the kernel module copied to the wrong
    folder (as it once was, after the layout moved it into specdec/layers/)."""
    broken = parse_dockerfile(
        "FROM python:3.11-slim AS torch\n"
        "FROM torch AS kernels\n"
        "COPY specdec/__init__.py specdec/layers/cpu_extension.py specdec/\n"
        "RUN python3 -m specdec.layers.cpu_extension prebuild /out\n")
    tree = tmp_path / "kernels"
    tree.mkdir()
    build_tree(broken[1], {stage.name: stage for stage in broken}, tree)
    result = import_from(tree, "specdec.layers.cpu_extension")
    assert result.returncode != 0 and "specdec" in result.stderr
