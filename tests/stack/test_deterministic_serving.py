"""Deterministic serving on the real default model in bf16, through the launched stack.

One set of prompts (the README's president question among them; chat prompts sharing the
chat template's head and a long user prefix, completions sharing nothing) is answered one at
a time and then all at once at concurrency 16, on a cold cache and on a warm one, with
speculation on and off per request, by stacks drafting with ngram, suffix, draft_model,
eagle and eagle3 (the shipped drafts), each with another prefill chunk size (16 and 32
tokens split every prompt). Every greedy answer must be the same text, and so must every
seeded sampled answer: the batch-invariant CPU kernels compute a token the same way whatever
else is in its step, where its prompt's head came from (cache hit or this prefill) and how
the prompt was chunked, and a seeded request draws per output position.

Where the kernels cannot serve bf16 (no AVX-512 BF16) the stack says it is not deterministic
and the comparisons are skipped.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from specdec.layers.cpu_extension import linear_supports
from specdec.models.model_files import DEFAULT_MODEL, resolve_model
from tests.support.served_stack import Stack, served_stack

pytestmark = [
    pytest.mark.skipif(not linear_supports(torch.bfloat16),
                       reason="bf16 is batch-invariant only on the AVX512-BF16 CPU kernels"),
    # A stack started per test, loading the model (and its draft) in bf16.
    pytest.mark.timeout(600),
]

MAX_TOKENS = 24
SEED = 7
STORY = ("Read this note. The lighthouse on the northern cape was kept for forty years by a "
         "woman named Ada Reyes, who logged every passing ship in a green notebook and fed the "
         "gulls each morning before dawn. ")
CHAT_PROMPTS = [
    "Who is the current US president?",
    "List the days of the week, one per line.",
    STORY + "Question: what was the keeper's name?",
    STORY + "Question: what colour was the notebook?",
]
COMPLETION_PROMPTS = ["def fibonacci(n):\n    "]
# (method, --speculative-config, --max-num-batched-tokens or None for the default)
STACKS = [
    ("ngram", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
              '"prompt_lookup_max": 3}', 16),
    ("suffix", '{"method": "suffix", "num_speculative_tokens": 4}', 32),
    ("draft_model", '{"method": "draft_model", "model": "smollm2-135m-instruct-draft", '
                    '"num_speculative_tokens": 3}', None),
    ("eagle", '{"method": "eagle", "model": "smollm2-135m-instruct-eagle", "num_speculative_tokens": 3}', 16),
    ("eagle3", '{"method": "eagle3", "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 3}', 32),
]
# Each request of a phase: (prompt index, greedy or seeded, speculation on).
KINDS = [(sampled, speculation) for sampled in (False, True) for speculation in (True, False)]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model(DEFAULT_MODEL)


async def _answer(client: openai.AsyncOpenAI, prompt_index: int, sampled: bool, speculation: bool) -> str:
    sampling = ({"temperature": 1.0, "seed": SEED} if sampled else {"temperature": 0.0})
    extra = {"speculation": speculation, "ignore_eos": True}
    if prompt_index < len(CHAT_PROMPTS):
        completion = await client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[prompt_index]}],
            max_tokens=MAX_TOKENS, extra_body=extra, **sampling)
        return completion.choices[0].message.content or ""
    text = await client.completions.create(model=DEFAULT_MODEL,
                                           prompt=COMPLETION_PROMPTS[prompt_index - len(CHAT_PROMPTS)],
                                           max_tokens=MAX_TOKENS, extra_body=extra, **sampling)
    return text.choices[0].text


Answers = dict[tuple[int, bool, bool], str]
REQUESTS = [(index, sampled, speculation) for index in range(len(CHAT_PROMPTS) + len(COMPLETION_PROMPTS))
            for sampled, speculation in KINDS]


async def _one_at_a_time(base_url: str) -> Answers:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300) as client:
        return {request: await _answer(client, *request) for request in REQUESTS}


async def _all_at_once(base_url: str) -> Answers:
    """Every request of the set in flight at once, at most 16 at a time."""
    limit = asyncio.Semaphore(16)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300) as client:
        async def one(request: tuple[int, bool, bool]) -> str:
            async with limit:
                return await _answer(client, *request)
        answers = await asyncio.gather(*(one(request) for request in REQUESTS))
    return dict(zip(REQUESTS, answers))


def _differences(answers: Answers, reference: dict[tuple[int, bool], str], where: str) -> list[str]:
    return [f"{where}, prompt {index}, {'seeded' if sampled else 'greedy'}, speculation "
            f"{'on' if speculation else 'off'}: {text!r} != {reference[index, sampled]!r}"
            for (index, sampled, speculation), text in answers.items() if text != reference[index, sampled]]


def _stack(model_dir: Path, spec: str, chunk: int | None) -> AbstractContextManager[Stack]:
    flags = ["--dtype", "bfloat16", "--speculative-config", spec, "--max-model-len", "1024",
             "--served-model-name", DEFAULT_MODEL]
    if chunk is not None:
        flags += ["--max-num-batched-tokens", str(chunk)]
    return served_stack(model_dir, *flags, ready_timeout_s=400)


# Per stack, two phases on its cold then warm cache: the first stack answers one at a time
# first (the reference: each request alone), the others all at once first, then one at a
# time or all at once again.
PHASES = {"one at a time": _one_at_a_time, "all at once": _all_at_once}
PHASE_ORDER = [("one at a time", "all at once"), ("all at once", "one at a time"), ("all at once", "all at once")]


def _serve_phases(model_dir: Path, position: int) -> dict[str, Answers]:
    method, spec, chunk = STACKS[position]
    cold, warm = PHASE_ORDER[0 if position == 0 else 1 if position % 2 else 2]
    with _stack(model_dir, spec, chunk) as stack:
        health = httpx.get(f"{stack.base_url}/health", timeout=10).json()
        assert health["deterministic"] is True, health
        return {f"{method} (chunk {chunk or 'default'}), cold, {cold}": asyncio.run(PHASES[cold](stack.base_url)),
                f"{method} (chunk {chunk or 'default'}), warm, {warm}": asyncio.run(PHASES[warm](stack.base_url))}


@pytest.fixture(scope="module")
def reference_run(model_dir: Path) -> dict[str, Answers]:
    """The first stack's phases; its first phase's answers with speculation off, each request
    alone on a cold cache, are the reference."""
    return _serve_phases(model_dir, 0)


def _reference(runs: dict[str, Answers]) -> dict[tuple[int, bool], str]:
    first = next(iter(runs.values()))
    return {(index, sampled): text for (index, sampled, speculation), text in first.items() if not speculation}


@pytest.mark.parametrize("position", range(len(STACKS)), ids=[method for method, _, _ in STACKS])
def test_every_answer_is_the_same_whatever_the_load_cache_chunking_and_method(
        model_dir: Path, reference_run: dict[str, Answers], position: int) -> None:
    reference = _reference(reference_run)
    assert all(reference.values())
    runs = reference_run if position == 0 else _serve_phases(model_dir, position)
    problems = [problem for where, answers in runs.items() for problem in _differences(answers, reference, where)]
    assert not problems, "\n".join(problems)
