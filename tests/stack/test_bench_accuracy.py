"""`python -m specdec bench accuracy`: scoring, the shipped tasks, and both runs through the
real gateway (the launcher on the tiny model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from specdec.bench import accuracy as bench_accuracy
from specdec.bench.accuracy import Task, is_correct, load_tasks, normalise
from tests.support.served_stack import Stack, free_port, served_stack
from tests.support.tiny_models import make_tiny_llama


@pytest.mark.parametrize("text,expected", [
    ("Paris", "paris"),
    ("  The answer is: 42.  ", "answer is 42"),
    ("**Tuesday**!", "tuesday"),
    ("an Apple a day", "apple day"),
    ("3.5", "35"),
    ("", ""),
])
def test_normalise(text: str, expected: str) -> None:
    assert normalise(text) == expected


ARITHMETIC = Task("a", "What is 17 + 25?", ("42",), r"(?:^|=|\bis)\s*42\b(?!\s*[-+*/])")
CAPITAL = Task("c", "Capital of France?", ("Paris",), r"\bParis\b")
NO_REGEX = Task("n", "Colour of grass?", ("green",))


@pytest.mark.parametrize("task,output,correct", [
    (ARITHMETIC, "42", True),
    (ARITHMETIC, "42.", True),
    (ARITHMETIC, "17 + 25 = 42", True),       # by regex
    (ARITHMETIC, "The answer is 42.", True),  # by regex
    (ARITHMETIC, "17 + 25 = 42, which is the sum", True),
    (ARITHMETIC, "142", False),
    (ARITHMETIC, "420", False),
    (ARITHMETIC, "= 42 + 1 = 43", False),
    (ARITHMETIC, "The answer is 43.", False),
    (ARITHMETIC, "", False),
    (CAPITAL, "paris", True),
    (CAPITAL, "The capital of France is Paris.", True),
    (CAPITAL, "Parisian", False),
    (NO_REGEX, "Green.", True),
    (NO_REGEX, "The green one", False),       # exact match only without a regex
    (NO_REGEX, "the Green", True),
])
def test_is_correct(task: Task, output: str, correct: bool) -> None:
    assert is_correct(task, output) is correct


def test_shipped_tasks() -> None:
    tasks = load_tasks()
    assert 60 <= len(tasks) <= 100
    assert len({task.id for task in tasks}) == len(tasks)
    assert {"arithmetic", "capital", "calendar", "colour", "units"} <= {t.category for t in tasks}
    for task in tasks:
        assert task.answers, task.id
        for answer in task.answers:  # every accepted answer scores, as said or in a sentence
            assert is_correct(task, answer), (task.id, answer)
            assert is_correct(task, f"{answer}."), (task.id, answer)
        assert not is_correct(task, "I do not know"), task.id


@pytest.mark.parametrize("line,message", [
    ("not json", "line 1: not JSON"),
    ('{"prompt": "x"}', 'needs "prompt" and "answers"'),
    ('{"prompt": "x", "answers": [1]}', 'needs "prompt" and "answers"'),
    ('{"prompt": "x", "answers": ["a"], "regex": "("}', 'bad "regex"'),
])
def test_bad_task_files_are_refused(tmp_path: Path, line: str, message: str, capsys) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(line + "\n")
    assert bench_accuracy.main(["--tasks", str(path)]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = make_tiny_llama(tmp_path_factory.mktemp("accuracy") / "tiny")
    with served_stack(model) as running:
        yield running


def _task_file(path: Path) -> Path:
    # The tiny model answers with "wN" words: three tasks accept any such answer, two never
    # score. Repeated words in the prompts give the ngram drafter something to match.
    lines = [{"id": f"any-{n}", "category": "any", "prompt": f"w{n} w{n + 1} w{n} w{n + 1}",
              "answers": [], "regex": r"^w\d+"} for n in (5, 9, 13)]
    lines += [{"id": f"never-{n}", "category": "never", "prompt": f"w{n} w{n + 2} w{n} w{n + 2}",
               "answers": ["paris"]} for n in (20, 30)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_both_runs_through_the_gateway(stack: Stack, tmp_path: Path, capsys) -> None:
    output = tmp_path / "accuracy.json"
    code = bench_accuracy.main([
        "--base-url", stack.base_url + "/v1", "--tasks", str(_task_file(tmp_path / "t.jsonl")),
        "--max-tokens", "12", "--max-concurrency", "2", "--disable-tqdm", "--json", str(output)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    summary = json.loads(output.read_text())
    assert summary["model"]  # taken from /v1/models
    runs = summary["runs"]
    assert list(runs) == ["speculation", "no_speculation"]
    for run in runs.values():
        assert (run["correct"], run["failed"], run["score"]) == (3, 0, 0.6)
        assert run["score_by_category"] == {"any": 1.0, "never": 0.0}
    # The extension reached the verifier: drafts with speculation, none without.
    assert runs["speculation"]["num_drafts"] > 0
    assert runs["no_speculation"]["num_drafts"] == 0
    # fp32 greedy: speculation changes no output.
    assert summary["identical_outputs"] == {"fraction": 1.0, "count": 5, "differing_ids": []}
    for item in summary["items"]:
        assert item["outputs"]["speculation"] == item["outputs"]["no_speculation"] != ""
    assert "identical outputs: 5/5 (1.000)" in printed
    assert "speculation" in printed and "no_speculation" in printed


def test_without_the_speculation_field_one_run(stack: Stack, tmp_path: Path) -> None:
    output = tmp_path / "accuracy.json"
    code = bench_accuracy.main([
        "--base-url", stack.base_url, "--tasks", str(_task_file(tmp_path / "t.jsonl")),
        "--max-tokens", "4", "--no-speculation-field", "--disable-tqdm", "--json", str(output)])
    assert code == 0
    summary = json.loads(output.read_text())
    assert list(summary["runs"]) == ["default"] and summary["identical_outputs"] is None
    assert summary["runs"]["default"]["correct"] == 3


def test_server_down_counts_failures(tmp_path: Path, capsys) -> None:
    output = tmp_path / "accuracy.json"
    code = bench_accuracy.main([
        "--base-url", f"http://127.0.0.1:{free_port()}", "--tasks",
        str(_task_file(tmp_path / "t.jsonl")), "--disable-tqdm", "--json", str(output)])
    captured = capsys.readouterr()
    assert code == 1 and "10 requests failed" in captured.err
    assert "Traceback" not in captured.out + captured.err
    summary = json.loads(output.read_text())
    assert summary["runs"]["speculation"]["failed"] == 5
    assert summary["runs"]["speculation"]["score"] == 0.0
    assert "ConnectError" in summary["items"][0]["errors"]["speculation"]


def test_routed_from_the_command_line(capsys) -> None:
    from specdec.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "accuracy", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    for flag in ("--base-url", "--model", "--max-concurrency", "--no-speculation-field",
                 "--json", "--tasks"):
        assert flag in printed, flag
