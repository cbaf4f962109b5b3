"""Every command README.md and docs/ show runs as written and reaches the port the client
examples use (issue 43, item 3).

Each `python -m ...` command in a fenced shell block is parsed by the command's own
parser (nothing runs); every served gateway and every client example meets on
DEFAULT_GATEWAY_PORT. Then the README's quick start runs for real on a tiny model (its
serve command as written, the model, device and port overridden), with its curl command
and its Python `openai` example pointed at that port.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from specdec.cli import DEFAULT_GATEWAY_PORT
from tests.support.served_stack import ROOT, Stack, served_stack
from tests.support.tiny_models import make_tiny_llama

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MODEL = "smollm2-135m-instruct"
# The project's own commands (`python -m pytest` and the like are someone else's).
MODULES = ("specdec", "gateway", "verifier_svc", "drafter_svc")


def fenced_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.S | re.M)


def shell_commands(block: str) -> list[list[str]]:
    """The block's commands as argv lists (continuations joined, comments and `&` dropped)."""
    commands, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quoted argument that goes on over the next line
            continue
        pending = ""
        if argv and argv[-1] == "&":
            argv.pop()
        if argv:
            commands.append(argv)
    assert not pending, f"an unclosed quote in {block!r}"
    return commands


def documented_commands(module_prefix: str = "") -> list[tuple[str, list[str]]]:
    """(document, argv after `python -m`) for every command of the project's shown."""
    found = []
    for document in DOCUMENTS:
        for block in fenced_blocks(document, "bash"):
            for argv in shell_commands(block):
                if (argv[:2] == ["python", "-m"] and argv[2] in MODULES
                        and argv[2].startswith(module_prefix)):
                    found.append((document.name, argv[2:]))
    return found


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def _entry_point(module: str) -> Callable[[list[str]], int]:
    if module == "specdec":
        from specdec.__main__ import main
    elif module == "gateway":
        from gateway.__main__ import main
    elif module == "verifier_svc":
        from verifier_svc.__main__ import main
    elif module == "drafter_svc":
        from drafter_svc.server import main
    else:
        raise AssertionError(f"a documented command runs an unknown module: {module}")
    return main


def parse_only(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The namespace the command's own parser makes of `argv`; nothing after parsing runs."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(parse_args(parser, *args, **kwargs))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed) as parsed:
        _entry_point(module)(argv)
    return parsed.value.namespace


@pytest.mark.parametrize("document, command", documented_commands(),
                         ids=lambda value: " ".join(value) if isinstance(value, list) else value)
def test_every_documented_command_parses_and_serves_on_the_examples_port(
        document: str, command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    namespace = parse_only(command[0], command[1:], monkeypatch)
    if command[:2] == ["specdec", "serve"] or command[0] == "gateway":
        assert namespace.port == DEFAULT_GATEWAY_PORT


def test_every_client_example_and_make_serve_use_the_gateways_default_port() -> None:
    urls = [(document.name, url) for document in DOCUMENTS
            for url in re.findall(r"https?://(?:127\.0\.0\.1|localhost):\d+", document.read_text())]
    assert urls
    assert {url.rsplit(":", 1)[1] for _, url in urls} == {str(DEFAULT_GATEWAY_PORT)}, urls
    assert f"PORT ?= {DEFAULT_GATEWAY_PORT}\n" in (ROOT / "Makefile").read_text()


def test_the_readmes_serve_commands_are_found() -> None:
    # A change of the README's layout must not make the tests above check nothing.
    methods = {json.loads(argv[argv.index("--speculative-config") + 1])["method"]
               for _, argv in documented_commands("specdec") if argv[1] == "serve"}
    assert {"ngram", "draft_model", "eagle", "eagle3"} <= methods


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """The README's first serve command as written, on a tiny model under the README's
    model name, on a free port."""
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-readme"))
    serve = next(argv for _, argv in documented_commands("specdec") if argv[1] == "serve")
    flags = [*serve[2:], "--model", str(model), "--served-model-name", README_MODEL]
    with served_stack(model, *flags) as stack:
        yield stack


def with_port(text: str, stack: Stack) -> str:
    return text.replace(f"http://127.0.0.1:{DEFAULT_GATEWAY_PORT}", stack.base_url)


def test_the_readmes_curl_example_answers(quick_start: Stack) -> None:
    readme = ROOT / "README.md"
    curls = [argv for block in fenced_blocks(readme, "bash") for argv in shell_commands(block)
             if argv[0] == "curl"]
    assert curls
    for argv in curls:
        result = subprocess.run([with_port(arg, quick_start) for arg in argv],
                                capture_output=True, text=True, timeout=120, check=True)
        answer = json.loads(result.stdout)
        assert answer["model"] == README_MODEL
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert answer["usage"]["completion_tokens"] > 0


def test_the_readmes_openai_example_runs(quick_start: Stack) -> None:
    blocks = [block for block in fenced_blocks(ROOT / "README.md", "python") if "OpenAI(" in block]
    assert blocks
    for block in blocks:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(with_port(block, quick_start), "README.md", "exec"), {})
        assert "num_drafts" in printed.getvalue()  # usage.speculation was printed
