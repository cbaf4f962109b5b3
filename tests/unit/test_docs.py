"""The user documentation (README.md, docs/*.md) points only at files the repository has.

Checked against the files themselves, not a list, so the check keeps working as modules
move: a markdown link `[text](path)` resolves from the document's own folder (as GitHub
resolves it), a path written in the text (`specdec/config.py`, `scripts/install-compose.sh`)
from the repository root. URLs are not followed. Nothing may point outside the
repository, and the README stays short enough to read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300

# [text](target) and ![alt](target); the target ends at whitespace or the closing paren.
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
# A repository path as the text writes it: folders, then a file with a source or data
# extension (`specdec/layers/csrc/linear_cpu.cpp`). Not preceded by a path character, so `/v1/...`,
# `~/.cache/...` and the tail of a longer path are not taken for one.
FILE_EXTENSIONS = ("py", "pyi", "sh", "cpp", "h", "proto", "md", "json", "jsonl", "toml",
                   "yml", "yaml", "txt", "cfg", "ini")
REPO_FILE = re.compile(
    r"(?<![\w./~$<>-])((?:[A-Za-z0-9_][\w.-]*/)+[\w.-]+\.(?:%s))(?![\w/-])"
    % "|".join(FILE_EXTENSIONS))
# A folder in inline code, written with its trailing slash: `specdec/drafts/`.
REPO_FOLDER = re.compile(r"`((?:[A-Za-z0-9_][\w.-]*/)+)`")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _is_inside_repo(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def link_targets(text: str) -> list[str]:
    """Relative link targets, without their #anchor; URLs and pure anchors left out."""
    targets = []
    for match in MARKDOWN_LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def written_paths(text: str) -> list[str]:
    """Repository paths written in the text: files with a known extension, and folders in
    inline code. Link targets are left to `link_targets` (they resolve elsewhere)."""
    text = MARKDOWN_LINK.sub(" ", text)
    text = URL.sub(" ", text)
    paths = [match.group(1) for match in REPO_FILE.finditer(text)]
    paths += [match.group(1) for match in REPO_FOLDER.finditer(text)]
    return paths


def test_the_docs_exist() -> None:
    assert (ROOT / "README.md").is_file()
    names = {path.name for path in DOCS}
    assert {"architecture.md", "api.md", "deployment.md", "performance.md", "drafts.md",
            "development.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_nothing_refers_outside_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert "../shared" not in text, f"{_doc_id(doc)} refers to ../shared"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_relative_link_exists(doc: Path) -> None:
    missing = []
    for target in link_targets(doc.read_text(encoding="utf-8")):
        resolved = doc.parent / target if target else doc
        if not _is_inside_repo(resolved) or not resolved.exists():
            missing.append(target)
    assert not missing, f"{_doc_id(doc)} links to paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_repository_path_exists(doc: Path) -> None:
    missing = sorted({path for path in written_paths(doc.read_text(encoding="utf-8"))
                      if not (ROOT / path).exists()})
    assert not missing, f"{_doc_id(doc)} names paths that do not exist: {missing}"


def test_the_readme_is_short() -> None:
    num_lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert num_lines <= README_MAX_LINES, f"README.md has {num_lines} lines"


def test_the_checks_see_links_and_paths() -> None:
    """The extractors find what the tests above rely on, and skip URLs and lookalikes."""
    text = ("See [the API](docs/api.md#errors), [home](https://example.com/a.md) and "
            "[top](#flags); edit `specdec/config.py`, run scripts/install-compose.sh, "
            "read `specdec/drafts/`, not `/v1/chat/completions`, `~/.cache/specdec/x.json`, "
            "http://example.com/specdec/x.py or `application/json`.")
    assert link_targets(text) == ["docs/api.md"]
    assert written_paths(text) == ["specdec/config.py", "scripts/install-compose.sh",
                                   "specdec/drafts/"]
