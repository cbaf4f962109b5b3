"""The adaptive policy served on the real default model with CPU-burning processes beside it
(issue #48 item 3): a copy request and a code edit (ngram's best cases, one at a time, as a
new user runs the README's example) are drafted for on a busy machine as on a quiet one.
Counts only, never speed; the figures are printed (`pytest -s`) so they can be quoted."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from specdec.bench.serve import BenchConfig, BenchRequest, run_benchmark
from specdec.models.model_files import DEFAULT_MODEL, resolve_model
from tests.support.served_stack import Stack, served_stack

pytestmark = pytest.mark.timeout(900)

NUM_BURNERS = 2
NGRAM_SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
              '"prompt_lookup_max": 4}')
CODE = '''def load_config(path):
    with open(path) as handle:
        data = json.load(handle)
    config = Config(data["name"], data["size"])
    return config


def save_config(config, path):
    with open(path, "w") as handle:
        json.dump({"name": config.name, "size": config.size}, handle)
'''


def requests() -> list[BenchRequest]:
    copy = [{"role": "user", "content": "Repeat this text exactly:\n\n" + CODE}]
    edit = [{"role": "user", "content": "Rename the function load_config to read_config in "
                                        "this code and print the whole code:\n\n" + CODE}]
    return [BenchRequest(messages=messages, max_tokens=96, options={"temperature": 0.0})
            for messages in (copy, edit, copy, edit)]


async def drafts_per_request(stack: Stack) -> list[int]:
    config = BenchConfig(base_url=stack.base_url, progress=False, timeout_s=120)
    counts = []
    for request in requests():
        [result] = (await run_benchmark(config, [request])).results
        assert result.success, result.error
        counts.append(result.speculation["num_drafts"] if result.speculation else 0)
    return counts


@contextmanager
def cpu_burners(count: int) -> Iterator[None]:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def test_a_busy_machine_drafts_a_copy_and_an_edit(tmp_path: Path) -> None:
    model = resolve_model(DEFAULT_MODEL)
    with served_stack(model, "--speculation-policy", "adaptive", "--speculative-config",
                      NGRAM_SPEC, ready_timeout_s=480) as stack:
        quiet = asyncio.run(drafts_per_request(stack))
        with cpu_burners(NUM_BURNERS):
            busy = asyncio.run(drafts_per_request(stack))
    print(f"\ndrafts per request, quiet: {quiet}; with {NUM_BURNERS} CPU burners: {busy}")
    assert all(count > 0 for count in quiet)
    assert all(count > 0 for count in busy)  # later requests too: not switched off by load
