"""A bounded load test of the whole stack, with the drafter killed in the middle.

The launcher serves the tiny model with ngram speculation. About 200 requests at mixed
lengths (max_tokens 1..48) and sampling settings (greedy, seeded temperature, top_p /
top_k, repetition penalty, stop strings; chat and completions; streamed and not) run at
concurrency 16 through `specdec.bench_serve`, while the test kills the drafter process:

- no request fails, and the launcher restarts the drafter instead of stopping the stack;
- every greedy request's text equals the same request with `"speculation": false`;
- speculation resumes with the new drafter;
- no KV block leaked: the pool holds exactly one max-model-len sequence, so a request of
  that length can only be scheduled when every block is free again.

The figures are printed (`pytest -s`) so they can be quoted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from specdec.bench_serve import BenchConfig, BenchRequest, RequestResult, run_benchmark, summarise
from tests.served_stack import Stack, free_port, served_stack
from tests.tiny_models import make_tiny_llama

NUM_REQUESTS = 200
CONCURRENCY = 16
BLOCK_SIZE = 16
NUM_BLOCKS = 128
MAX_MODEL_LEN = NUM_BLOCKS * BLOCK_SIZE  # one full-length sequence takes every block
KILL_AFTER = NUM_REQUESTS // 3
VOCAB_SIZE = 96


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-load"),
                           max_positions=MAX_MODEL_LEN)


def words(rng: random.Random, length: int) -> str:
    """Text the tiny tokenizer maps one word to one token; repeats give ngram matches."""
    motif = [f"w{rng.randrange(3, VOCAB_SIZE)}" for _ in range(rng.randint(2, 5))]
    return " ".join((motif * length)[:length])


def mixed_requests(seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = []
    for index in range(NUM_REQUESTS):
        kind = index % 5
        options: dict[str, Any] = {"temperature": 0.0}
        if kind == 1:
            options = {"temperature": 0.8, "seed": index, "top_p": 0.9, "top_k": 20}
        elif kind == 2:
            options["repetition_penalty"] = 1.3
        elif kind == 3:
            options["stop"] = [f"w{rng.randrange(3, VOCAB_SIZE)}", "w1"]
        elif kind == 4:
            options.update(top_p=0.5, top_k=5)
        prompt_text = words(rng, rng.randint(4, 40))
        chat = rng.random() < 0.6
        requests.append(BenchRequest(
            messages=[{"role": "user", "content": prompt_text}] if chat else None,
            prompt=None if chat else prompt_text, max_tokens=rng.randint(1, 48),
            stream=rng.random() < 0.6, options=options))
    return requests


def kill_drafter_when(stack: Stack, signal_event: asyncio.Event, killed: list[int]):
    async def kill() -> None:
        await signal_event.wait()
        [pid] = stack.child_pids("drafter_svc")
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    return kill()


async def load_with_drafter_kill(stack: Stack) -> tuple[dict[str, Any], list[RequestResult],
                                                         list[BenchRequest], int]:
    requests = mixed_requests(seed=0)
    config = BenchConfig(base_url=stack.base_url, max_concurrency=CONCURRENCY, progress=False,
                         timeout_s=60)
    time_to_kill = asyncio.Event()
    num_done = 0

    def on_result(result: RequestResult) -> None:
        nonlocal num_done
        num_done += 1
        if num_done == KILL_AFTER:
            time_to_kill.set()

    killed: list[int] = []
    killer = asyncio.create_task(kill_drafter_when(stack, time_to_kill, killed))
    report = await run_benchmark(config, requests, on_result)
    await killer
    return summarise(report), report.results, requests, killed[0]


async def plain_reference(stack: Stack, requests: list[BenchRequest]) -> list[RequestResult]:
    plain = [dataclasses.replace(r, options={**r.options, "speculation": False})
             for r in requests]
    config = BenchConfig(base_url=stack.base_url, max_concurrency=CONCURRENCY, progress=False,
                         timeout_s=60)
    return (await run_benchmark(config, plain)).results


async def drafts_again(stack: Stack, timeout_s: float) -> int:
    """Sends repetitive greedy requests until one is drafted for; its number of drafts."""
    config = BenchConfig(base_url=stack.base_url, progress=False, timeout_s=30)
    request = BenchRequest(prompt=" ".join(["w5 w6 w7"] * 8), max_tokens=24,
                           options={"temperature": 0.0, "ignore_eos": True})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        [result] = (await run_benchmark(config, [request])).results
        assert result.success, result.error
        if result.speculation and result.speculation["num_drafts"]:
            return result.speculation["num_drafts"]
        await asyncio.sleep(0.2)
    return 0


async def full_pool_request(stack: Stack) -> RequestResult:
    """A request of exactly max_model_len tokens: it needs every KV block of the pool."""
    config = BenchConfig(base_url=stack.base_url, progress=False, timeout_s=30)
    prompt = [3 + i % (VOCAB_SIZE - 3) for i in range(MAX_MODEL_LEN - 6)]
    request = BenchRequest(prompt=prompt, max_tokens=6, stream=False,
                           options={"temperature": 0.0, "ignore_eos": True})
    [result] = (await run_benchmark(config, [request])).results
    return result


def verifier_gauges(metrics_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_load_with_a_drafter_restart(tiny_model: Path) -> None:
    metrics_port = free_port()
    with served_stack(tiny_model, "--max-model-len", str(MAX_MODEL_LEN),
                      "--block-size", str(BLOCK_SIZE),
                      "--num-gpu-blocks-override", str(NUM_BLOCKS),
                      "--verifier-metrics-port", str(metrics_port)) as stack:
        [first_drafter] = stack.child_pids("drafter_svc")
        summary, results, requests, killed = asyncio.run(load_with_drafter_kill(stack))
        assert killed == first_drafter
        failures = [(r.index, r.error) for r in results if not r.success]
        assert summary["failed"] == 0 and summary["completed"] == NUM_REQUESTS, failures[:5]
        assert stack.launcher.poll() is None, "the launcher stopped the stack"

        deadline = time.monotonic() + 15
        while stack.child_pids("drafter_svc") in ([], [killed]) and time.monotonic() < deadline:
            time.sleep(0.1)
        [new_drafter] = stack.child_pids("drafter_svc")
        assert new_drafter != killed
        drafts_after_restart = asyncio.run(drafts_again(stack, timeout_s=30))
        assert drafts_after_restart > 0, "no drafts after the drafter restart"

        greedy = [i for i, r in enumerate(requests) if r.options["temperature"] == 0.0]
        reference = asyncio.run(plain_reference(stack, [requests[i] for i in greedy]))
        assert all(r.success for r in reference), [r.error for r in reference if not r.success]
        mismatches = [i for i, plain in zip(greedy, reference)
                      if (results[i].text, results[i].finish_reason)
                      != (plain.text, plain.finish_reason)]
        assert not mismatches, (f"{len(mismatches)} greedy outputs differ from plain decoding, "
                                f"e.g. request {mismatches[0]}: {results[mismatches[0]].text!r} "
                                f"!= {reference[greedy.index(mismatches[0])].text!r}")

        probe = asyncio.run(full_pool_request(stack))
        assert probe.success, f"KV blocks leaked: a full-pool request did not run ({probe.error})"
        assert probe.num_output_tokens == 6
        gauges = verifier_gauges(metrics_port)
        assert gauges["specdec:kv_cache_free_blocks"] == gauges["specdec:kv_cache_blocks"] == NUM_BLOCKS
        assert gauges["vllm:num_requests_running"] == gauges["vllm:num_requests_waiting"] == 0

    spec = summary["speculation"]
    print(f"\nload test: {summary['completed']} requests ok, {summary['failed']} failed, "
          f"{summary['duration_s']:.2f} s, {summary['request_throughput']:.1f} req/s, "
          f"{summary['output_throughput']:.0f} output tok/s at concurrency {CONCURRENCY}; "
          f"TTFT median {summary['median_ttft_ms']:.1f} ms, TPOT median "
          f"{summary['median_tpot_ms']:.2f} ms; drafter killed after {KILL_AFTER} requests "
          f"and restarted (pid {killed} -> {new_drafter}); speculation ({spec['source']}): "
          f"{spec['num_drafts']} drafts, acceptance rate {spec['acceptance_rate']:.3f}, mean "
          f"acceptance length {spec['mean_acceptance_length']:.2f}, per position "
          f"{[round(rate, 3) for rate in spec['per_position_acceptance']]}; {len(greedy)} greedy "
          f"outputs equal plain decoding; full-pool request ran ({NUM_BLOCKS} blocks: none "
          f"leaked)")
