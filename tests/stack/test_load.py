"""Bounded load tests of the whole stack, with replicas killed in the middle.

1. The launcher serves the tiny model with ngram speculation. About 200 requests at mixed
lengths (max_tokens 1..48) and sampling settings (greedy, seeded temperature, top_p /
top_k, repetition penalty, stop strings; chat and completions; streamed and not) run at
concurrency 16 through `specdec.bench.serve`, while the test kills the drafter process:

- no request fails, and the launcher restarts the drafter instead of stopping the stack;
- every greedy request's text equals the same request with `"speculation": false`;
- speculation resumes with the new drafter;
- no KV block leaked: the pool holds exactly one max-model-len sequence, so a request of
  that length can only be scheduled when every block is free again.

2. Chaos (issue #28, item 10): two drafter and two verifier processes behind one gateway
(an internal token between them). The same mix runs while one drafter is killed
(SIGKILL) and restarted on its port, and then one verifier is killed while it has queued
requests and restarted on its port:

- the only failed requests are those the gateway logged as failed mid-stream on the killed
  verifier (they had started streaming there); every other request succeeds, the queued
  ones through the gateway's retry on the other verifier;
- no KV block is leaked on either verifier; every greedy output equals plain decoding;
- both restarted replicas serve again: the verifier takes requests, the drafter drafts.

The figures are printed (`pytest -s`) so they can be quoted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from specdec.bench.serve import (
    BenchConfig,
    BenchRequest,
    RequestResult,
    run_benchmark,
    summarise,
)
from tests.support.served_stack import ENV, NGRAM_SPEC, ROOT, Stack, free_port, served_stack
from tests.support.tiny_models import make_tiny_llama

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


def mixed_requests(seed: int, count: int = NUM_REQUESTS) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = []
    for index in range(count):
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


# ---------------------------------------------------------------- chaos: two verifiers

CHAOS_REQUESTS = 300
KILL_DRAFTER_AFTER = 50
KILL_VERIFIER_AFTER = 120
# The verifier that is killed runs few sequences at once, so it has queued requests (no
# token sent yet) to be retried on the other when it dies.
DOOMED_MAX_NUM_SEQS = 2
MID_STREAM = re.compile(r"verifier (\S+) failed request \S+ mid-stream")
RETRY = re.compile(r"request \S+: retrying on verifier (\S+)")


class Service:
    """One child process; restartable with the same command (so on the same port)."""

    def __init__(self, name: str, command: list[str], log_dir: Path) -> None:
        self.name, self.command, self.log_dir = name, command, log_dir
        self.logs: list[Path] = []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_dir / f"{self.name}-{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env=CHAOS_ENV, stdout=out,
                                         stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, f"{self.name} died early"
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_text(self) -> str:
        return "".join(log.read_text(errors="replace") for log in self.logs)


CHAOS_ENV = dict(ENV, SPECDEC_INTERNAL_TOKEN=secrets.token_urlsafe(32))


@dataclass
class ChaosStack:
    base_url: str
    drafters: list[Service]
    verifiers: list[Service]
    verifier_ports: list[int]
    verifier_metrics: list[int]
    drafter_metrics: list[int]
    gateway: Service

    @property
    def services(self) -> list[Service]:
        return [*self.drafters, *self.verifiers, self.gateway]


@contextmanager
def chaos_stack(model: Path, log_dir: Path) -> Iterator[ChaosStack]:
    python = sys.executable
    drafter_ports, verifier_ports = [free_port(), free_port()], [free_port(), free_port()]
    drafter_metrics, verifier_metrics = [free_port(), free_port()], [free_port(), free_port()]
    gateway_port = free_port()
    common = ["--log-level", "warning"]
    drafters = [Service(f"drafter{i}", [
        python, "-m", "drafter_svc", "--port", str(port), "--target-model", str(model),
        "--speculative-config", NGRAM_SPEC, "--metrics-port", str(drafter_metrics[i]), *common],
        log_dir) for i, port in enumerate(drafter_ports)]
    verifiers = [Service(f"verifier{i}", [
        python, "-m", "verifier_svc", "--model", str(model), "--port", str(port),
        "--device", "cpu", "--dtype", "float32", "--enforce-eager", "--threads", "1",
        "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--speculative-config", NGRAM_SPEC,
        "--speculation-policy", "fixed", "--metrics-port", str(verifier_metrics[i]),
        *[arg for d in drafter_ports for arg in ("--drafter", f"127.0.0.1:{d}")],
        "--drafter-wait-s", "30", *(["--max-num-seqs", str(DOOMED_MAX_NUM_SEQS),
                                     "--max-waiting-requests", "64"] if i == 1 else []),
        *common], log_dir) for i, port in enumerate(verifier_ports)]
    gateway = Service("gateway", [
        python, "-m", "gateway", "--model", str(model), "--port", str(gateway_port),
        *[arg for v in verifier_ports for arg in ("--verifier", f"127.0.0.1:{v}")], *common],
        log_dir)
    stack = ChaosStack(f"http://127.0.0.1:{gateway_port}", drafters, verifiers, verifier_ports,
                       verifier_metrics, drafter_metrics, gateway)
    try:
        for service in stack.services:
            service.start()
        assert wait_for(lambda: both_verifiers_serving(stack), 120), "the stack did not start"
        yield stack
    finally:
        for service in reversed(stack.services):
            service.stop()


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def both_verifiers_serving(stack: ChaosStack) -> bool:
    body = httpx.get(f"{stack.base_url}/health", timeout=5).json()
    return sorted(body["verifiers"].values()) == ["serving", "serving"]


scrape = verifier_gauges  # the drafters' /metrics read the same way


async def run_with_chaos(stack: ChaosStack, requests: list[BenchRequest],
                         ) -> tuple[list[RequestResult], dict[str, float]]:
    """The requests, killing and restarting drafter 0 and then verifier 1 on the way."""
    config = BenchConfig(base_url=stack.base_url, max_concurrency=CONCURRENCY, progress=False,
                         timeout_s=120)
    kill_drafter, kill_verifier = asyncio.Event(), asyncio.Event()
    done = 0
    figures: dict[str, float] = {}

    def on_result(result: RequestResult) -> None:
        nonlocal done
        done += 1
        if done == KILL_DRAFTER_AFTER:
            kill_drafter.set()
        if done == KILL_VERIFIER_AFTER:
            kill_verifier.set()

    async def chaos() -> None:
        await kill_drafter.wait()
        stack.drafters[0].kill()
        stack.drafters[0].start()
        await kill_verifier.wait()
        # Killed while requests wait in its queue: they have no token yet, so they move.
        port = stack.verifier_metrics[1]
        queued = await asyncio.to_thread(
            wait_for, lambda: scrape(port)["vllm:num_requests_waiting"] >= 3, 30)
        figures["queued_at_kill"] = scrape(port)["vllm:num_requests_waiting"] if queued else 0
        stack.verifiers[1].kill()
        figures["killed_at"] = done
        stack.verifiers[1].start()

    chaos_task = asyncio.create_task(chaos())
    report = await run_benchmark(config, requests, on_result)
    await chaos_task
    return report.results, figures


def test_load_with_a_drafter_and_a_verifier_killed(tiny_model: Path, tmp_path: Path) -> None:
    requests = mixed_requests(seed=1, count=CHAOS_REQUESTS)
    greedy = [i for i, r in enumerate(requests) if r.options["temperature"] == 0.0]
    with chaos_stack(tiny_model, tmp_path) as stack:
        started = time.monotonic()
        results, figures = asyncio.run(run_with_chaos(stack, requests))
        duration_s = time.monotonic() - started
        # Both restarted replicas come back: the verifier in the gateway's rotation, the
        # drafter in both verifiers' pools.
        assert wait_for(lambda: both_verifiers_serving(stack), 120), "verifier 1 did not return"
        assert wait_for(lambda: all(scrape(port)["specdec:drafter_healthy_replicas"] == 2
                                    for port in stack.verifier_metrics), 60)
        reference = asyncio.run(plain_reference(stack, [requests[i] for i in greedy]))
        assert all(r.success for r in reference), [r.error for r in reference if not r.success]
        # Speculative requests again, on both verifiers and both drafters.
        again = asyncio.run(run_benchmark(
            BenchConfig(base_url=stack.base_url, max_concurrency=CONCURRENCY, progress=False,
                        timeout_s=60), [requests[i] for i in greedy[:32]])).results
        gauges = [scrape(port) for port in stack.verifier_metrics]
        restarted_drafter_steps = scrape(stack.drafter_metrics[0])["specdec:drafter_steps_total"]
        gateway_log = stack.gateway.log_text()

    failures = [r for r in results if not r.success]
    mid_stream = MID_STREAM.findall(gateway_log)
    retries = RETRY.findall(gateway_log)
    doomed = f"127.0.0.1:{stack.verifier_ports[1]}"
    leaked = [g["specdec:kv_cache_blocks"] - g["specdec:kv_cache_free_blocks"] for g in gauges]
    drafts = sum(g["vllm:spec_decode_num_drafts_total"] for g in gauges)
    mismatches = [i for i, plain in zip(greedy, reference) if results[i].success
                  and (results[i].text, results[i].finish_reason) != (plain.text, plain.finish_reason)]
    print(f"\nchaos load test: {len(requests)} requests ({len(greedy)} greedy) at concurrency "
          f"{CONCURRENCY} in {duration_s:.1f} s; drafter 0 killed after {KILL_DRAFTER_AFTER} "
          f"and restarted; verifier 1 killed after {figures['killed_at']} with "
          f"{figures['queued_at_kill']:.0f} queued, and restarted; {len(failures)} failed "
          f"(all mid-stream on the killed verifier: {len(mid_stream)} logged), "
          f"{len(retries)} retried on another verifier before their first token; leaked KV "
          f"blocks per verifier {leaked}; {len(greedy) - len(mismatches)} greedy outputs equal "
          f"plain decoding; {drafts:.0f} drafts verified; restarted drafter answered "
          f"{restarted_drafter_steps:.0f} steps")
    assert set(mid_stream) <= {doomed}, mid_stream
    assert len(failures) == len(mid_stream), (
        f"{len(failures)} failed but {len(mid_stream)} were mid-stream on the killed verifier: "
        f"{[r.error for r in failures][:5]}")
    assert figures["queued_at_kill"] >= 1 and len(retries) >= 1
    assert not mismatches, f"greedy outputs differ from plain decoding: {mismatches[:5]}"
    assert all(r.success for r in again) and all(
        (r.text, r.finish_reason) == (plain.text, plain.finish_reason)
        for r, plain in zip(again, reference))
    assert leaked == [0, 0]
    assert all(g["vllm:num_requests_running"] == g["vllm:num_requests_waiting"] == 0 for g in gauges)
    assert all(g["vllm:e2e_request_latency_seconds_count"] > 0 for g in gauges)
    assert restarted_drafter_steps > 0 and drafts > 0
