"""`python -m specdec bench accuracy`: a small exact-answer task set, with and without speculation.

Speculation must not change what a model answers: greedy output with it equals output
without it (docs/architecture.md). This command checks that end to end over the OpenAI API, on short
questions with known answers (arithmetic, capitals, days and months, colours, units;
`specdec/evals/tasks.jsonl`), and scores the answers so that the same run scores any other
OpenAI-compatible engine too.

Each task goes out twice at temperature 0, as a chat completion: once as is (the server's
speculation) and once with specdec's request extension `"speculation": false`. Against a
server that does not know that field, `--no-speculation-field` sends each task once, plain.
A task is correct when the normalised output equals a normalised accepted answer (SQuAD's
normalisation: lower case, no punctuation, no articles, single spaces), or when its regex
(case-insensitive, searched in the stripped output) matches. The report gives each run's
score and the fraction of tasks whose two outputs are identical.

The HTTP client is httpx, a core dependency: the command works without the test extra (and
so without the `openai` package), and it sends the extension field as plain JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import string
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from specdec.cli import DEFAULT_GATEWAY_PORT, DefaultsHelpFormatter
from specdec.bench.serve import fetch_model
from specdec.bench.serve_requests import describe_error

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = f"http://127.0.0.1:{DEFAULT_GATEWAY_PORT}"
BUILTIN_TASKS = "builtin"
# Run name -> the extra body fields of its requests.
RUNS_WITH_FIELD: dict[str, dict[str, Any]] = {"speculation": {}, "no_speculation": {"speculation": False}}
RUNS_WITHOUT_FIELD: dict[str, dict[str, Any]] = {"default": {}}
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


@dataclass(frozen=True, slots=True)
class Task:
    id: str
    prompt: str
    answers: tuple[str, ...]
    regex: str | None = None
    category: str = ""


@dataclass(slots=True)
class Answer:
    text: str = ""
    error: str = ""
    num_drafts: int | None = None  # usage.speculation.num_drafts, when the server sends it


@dataclass(slots=True)
class RunReport:
    name: str
    answers: dict[str, Answer] = field(default_factory=dict)
    seconds: float = 0.0


# ------------------------------------------------------------------ tasks and scoring

def normalise(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def is_correct(task: Task, output: str) -> bool:
    answer = normalise(output)
    if answer and any(answer == normalise(accepted) for accepted in task.answers):
        return True
    return task.regex is not None and re.search(task.regex, output.strip(), re.IGNORECASE) is not None


def load_tasks(source: str = BUILTIN_TASKS) -> list[Task]:
    """Tasks from JSONL lines {"id", "prompt", "answers": [...], optional "regex", "category"}."""
    if source == BUILTIN_TASKS:
        text = resources.files("specdec").joinpath("evals/tasks.jsonl").read_text("utf-8")
    else:
        try:
            text = Path(source).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--tasks {source}: {exc}") from None
    tasks: list[Task] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: not JSON") from None
        answers = raw.get("answers") if isinstance(raw, dict) else None
        if (not isinstance(raw, dict) or not isinstance(raw.get("prompt"), str)
                or not isinstance(answers, list) or not all(isinstance(a, str) for a in answers)
                or not (answers or raw.get("regex"))):
            raise ValueError(f'{where}: needs "prompt" and "answers" (strings) or "regex"')
        regex = raw.get("regex")
        if regex is not None:
            try:
                re.compile(regex)
            except (re.error, TypeError) as exc:
                raise ValueError(f'{where}: bad "regex": {exc}') from None
        tasks.append(Task(str(raw.get("id", number)), raw["prompt"], tuple(answers), regex,
                          str(raw.get("category", ""))))
    if not tasks:
        raise ValueError(f"--tasks {source} has no tasks")
    if len({task.id for task in tasks}) != len(tasks):
        raise ValueError(f"--tasks {source}: task ids are not unique")
    return tasks


# ------------------------------------------------------------------ the runs

async def ask(client: httpx.AsyncClient, model: str | None, task: Task, max_tokens: int,
              extra: dict[str, Any]) -> Answer:
    """One greedy chat completion; a failure is recorded in the answer, never raised."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": task.prompt}],
                            "temperature": 0, "max_tokens": max_tokens, **extra}
    if model is not None:
        body["model"] = model
    try:
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            return Answer(error=f"HTTP {response.status_code}: {response.text[:200]}")
        payload = response.json()
        text = payload["choices"][0]["message"]["content"] or ""
        speculation = (payload.get("usage") or {}).get("speculation")
        drafts = speculation.get("num_drafts") if isinstance(speculation, dict) else None
        return Answer(text=text, num_drafts=drafts)
    except Exception as exc:
        return Answer(error=describe_error(exc))


async def run_accuracy(base_url: str, tasks: list[Task], *, model: str | None = None,
                       runs: dict[str, dict[str, Any]] = RUNS_WITH_FIELD, max_tokens: int = 32,
                       max_concurrency: int = 8, api_key: str | None = None,
                       timeout_s: float = 300.0, progress: bool = True,
                       ) -> tuple[str | None, list[RunReport]]:
    """Sends every task once per run (runs one after the other); returns the model asked."""
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(max_concurrency)
    reports = []
    async with httpx.AsyncClient(base_url=base_url.rstrip("/").removesuffix("/v1"),
                                 headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                 limits=httpx.Limits(max_connections=max_concurrency)) as client:
        model = model or await fetch_model(client)
        for name, extra in runs.items():
            report = RunReport(name)
            with tqdm(total=len(tasks), desc=name, unit="task", file=sys.stderr,
                      disable=not progress) as bar:

                async def one(task: Task, report: RunReport = report, extra: dict = extra) -> None:
                    async with semaphore:
                        report.answers[task.id] = await ask(client, model, task, max_tokens, extra)
                    bar.update()

                started = time.perf_counter()
                await asyncio.gather(*(one(task) for task in tasks))
                report.seconds = time.perf_counter() - started
            reports.append(report)
    return model, reports


def summarise(tasks: list[Task], reports: list[RunReport]) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for report in reports:
        correct = {task.id: not report.answers[task.id].error
                   and is_correct(task, report.answers[task.id].text) for task in tasks}
        by_category: dict[str, list[bool]] = defaultdict(list)
        for task in tasks:
            by_category[task.category].append(correct[task.id])
        drafts = [a.num_drafts for a in report.answers.values() if a.num_drafts is not None]
        runs[report.name] = {
            "score": round(sum(correct.values()) / len(tasks), 4),
            "correct": sum(correct.values()),
            "failed": sum(1 for a in report.answers.values() if a.error),
            "seconds": round(report.seconds, 2),
            "num_drafts": sum(drafts) if drafts else None,
            "score_by_category": {name: round(sum(v) / len(v), 4)
                                  for name, v in sorted(by_category.items())},
        }
    identical = None
    if len(reports) == 2:
        first, second = (r.answers for r in reports)
        same = [t.id for t in tasks if not first[t.id].error and not second[t.id].error
                and first[t.id].text == second[t.id].text]
        identical = {"fraction": round(len(same) / len(tasks), 4), "count": len(same),
                     "differing_ids": [t.id for t in tasks if t.id not in set(same)]}
    items = [{"id": t.id, "category": t.category, "prompt": t.prompt, "answers": list(t.answers),
              "regex": t.regex,
              "outputs": {r.name: r.answers[t.id].text for r in reports},
              "errors": {r.name: r.answers[t.id].error for r in reports if r.answers[t.id].error},
              "correct": {r.name: not r.answers[t.id].error
                          and is_correct(t, r.answers[t.id].text) for r in reports}}
             for t in tasks]
    return {"num_tasks": len(tasks), "runs": runs, "identical_outputs": identical,
            "items": items}


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{'run':16} {'score':>6} {'correct':>9} {'failed':>6} {'seconds':>8} {'drafts':>7}"]
    for name, run in summary["runs"].items():
        drafts = "-" if run["num_drafts"] is None else str(run["num_drafts"])
        lines.append(f"{name:16} {run['score']:>6.3f} {run['correct']:>4}/{summary['num_tasks']:<4} "
                     f"{run['failed']:>6} {run['seconds']:>8.1f} {drafts:>7}")
    categories = next(iter(summary["runs"].values()))["score_by_category"]
    for category in categories:
        scores = " / ".join(f"{run['score_by_category'][category]:.3f}"
                            for run in summary["runs"].values())
        lines.append(f"  {category or '(none)':14} {scores}")
    identical = summary["identical_outputs"]
    if identical is not None:
        lines.append(f"identical outputs: {identical['count']}/{summary['num_tasks']} "
                     f"({identical['fraction']:.3f})")
        if identical["differing_ids"]:
            lines.append("  differing: " + ", ".join(identical["differing_ids"][:20]))
    return "\n".join(lines)


# ------------------------------------------------------------------ the command

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="python -m specdec bench accuracy",
        description="Score a server on short exact-answer tasks with and without speculation "
                    "and count identical outputs (any OpenAI-compatible server).")
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help="server root, e.g. %(default)s (a trailing /v1 is accepted)")
    parser.add_argument("--model", default=None,
                        help="served model name (default: the first of GET /v1/models)")
    parser.add_argument("--tasks", default=BUILTIN_TASKS,
                        help="'builtin' (specdec/evals/tasks.jsonl) or a JSONL file of "
                             '{"id", "prompt", "answers": [...], optional "regex", "category"}')
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8,
                        help="at most this many requests in flight (default %(default)s)")
    parser.add_argument("--no-speculation-field", action="store_true",
                        help="the server does not know specdec's \"speculation\" field: send "
                             "each task once, without it")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write scores, per-task outputs and the identity check here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s bench-accuracy %(levelname)s %(name)s: %(message)s")
    try:
        for flag, value in (("--max-tokens", args.max_tokens),
                            ("--max-concurrency", args.max_concurrency)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        tasks = load_tasks(args.tasks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs = RUNS_WITHOUT_FIELD if args.no_speculation_field else RUNS_WITH_FIELD
    model, reports = asyncio.run(run_accuracy(
        args.base_url, tasks, model=args.model, runs=runs, max_tokens=args.max_tokens,
        max_concurrency=args.max_concurrency, api_key=args.api_key, timeout_s=args.timeout,
        progress=not args.disable_tqdm))
    summary = {"base_url": args.base_url, "model": model, "tasks": args.tasks,
               "max_tokens": args.max_tokens, **summarise(tasks, reports)}
    print(f"model {model} at {args.base_url}, {len(tasks)} tasks, greedy, "
          f"max_tokens {args.max_tokens}")
    print(format_summary(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    failed = sum(run["failed"] for run in summary["runs"].values())
    if failed:
        print(f"{failed} requests failed", file=sys.stderr)
        return 1
    return 0
