"""A soak of mixed traffic through the launched stack, with the drafter killed once (issue 44).

The whole stack (launcher, gateway, verifier, ngram drafter) on the real default model:
SPECDEC_SOAK_S seconds (120 by default, the CI figure) at concurrency 32 of structured
(json_schema, regex, choice), plain, n > 1, logprobs and stop-string requests, the drafter
process SIGKILLed a third of the way in (the launcher restarts it). Every request must
succeed and be well formed (structured outputs valid); a killed drafter may only cost
speed. Afterwards the verifier's KV blocks are back to idle (its Prometheus metrics) and
its RSS is within MEMORY_MARGIN of what it was after a warm-up at the same load. Bounded:
loopback only, a fixed number of workers, each request with a small max_tokens and a
timeout. The figures are printed (`pytest -s` shows them).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from specdec.models.model_files import DEFAULT_MODEL, resolve_model
from tests.support.served_stack import Stack, free_port, served_stack

SOAK_S = float(os.environ.get("SPECDEC_SOAK_S", "120"))
WARMUP_S = 15.0
CONCURRENCY = 32
# RSS after the soak may exceed RSS after the warm-up by this fraction (allocator caches;
# the KV pool is small and touched whole by the warm-up, so growth beyond means a leak).
MEMORY_MARGIN = 0.25
# Start (model fetch, kernels) plus warm-up, soak and drain on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(600 + 3 * SOAK_S)

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]
STOP = "."


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 24, "temperature": 0, **fields}


def _check_json(body: dict[str, Any]) -> None:
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def _check_regex(body: dict[str, Any]) -> None:
    text = body["choices"][0]["message"]["content"]
    assert re.fullmatch(PHONE, text) or body["choices"][0]["finish_reason"] == "length", text


def _check_choice(body: dict[str, Any]) -> None:
    assert body["choices"][0]["message"]["content"] in CHOICES


def _check_n(body: dict[str, Any]) -> None:
    assert sorted(choice["index"] for choice in body["choices"]) == [0, 1]


def _check_logprobs(body: dict[str, Any]) -> None:
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)


def _check_stop(body: dict[str, Any]) -> None:
    assert STOP not in body["choices"][0]["message"]["content"]


def _check_text(body: dict[str, Any]) -> None:
    assert body["choices"][0]["message"]["content"] is not None


# (name, request body, check of the answer): the mix each worker cycles through.
KINDS: list[tuple[str, dict[str, Any], Callable[[dict[str, Any]], None]]] = [
    ("json_schema", _chat("Pick a city as JSON.", response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}),
     _check_json),
    ("regex", _chat("Give a phone number.", structured_outputs={"regex": PHONE}),
     _check_regex),
    ("choice", _chat("Is the sky blue?", structured_outputs={"choice": CHOICES}),
     _check_choice),
    ("plain", _chat("Tell me about the sea."), _check_text),
    ("n2", _chat("Name a colour.", n=2, temperature=0.8, seed=1), _check_n),
    ("logprobs", _chat("Count to ten.", logprobs=True, top_logprobs=2), _check_logprobs),
    ("stop", _chat("Write two sentences about cats.", stop=[STOP]), _check_stop),
]


class Load:
    """CONCURRENCY workers sending KINDS round-robin until `stop_at`; records every outcome."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._counter = itertools.count()

    def run(self, duration_s: float) -> None:
        stop_at = time.monotonic() + duration_s
        workers = [threading.Thread(target=self._work, args=(stop_at,))
                   for _ in range(CONCURRENCY)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    def _work(self, stop_at: float) -> None:
        with httpx.Client(base_url=self.base_url, timeout=300) as client:
            while time.monotonic() < stop_at:
                name, body, check = KINDS[next(self._counter) % len(KINDS)]
                started = time.monotonic()
                try:
                    response = client.post("/v1/chat/completions", json=body)
                    assert response.status_code == 200, f"{response.status_code}: {response.text}"
                    check(response.json())
                except Exception as exc:  # every failure is recorded, none stops the load
                    with self._lock:
                        self.failures.append(f"{name}: {exc!r}"[:300])
                    continue
                with self._lock:
                    self.latencies_s.append(time.monotonic() - started)


def _metric(metrics_port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not among the verifier's metrics")


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def stack_and_metrics() -> Iterator[tuple[Stack, int]]:
    metrics_port = free_port()
    with served_stack(resolve_model(DEFAULT_MODEL), "--max-model-len", "1024",
                      "--served-model-name", DEFAULT_MODEL, "--max-num-seqs", "64",
                      # A pool the warm-up touches whole (fresh blocks are taken first), so
                      # RSS measures leaks, not KV pages touched for the first time.
                      "--num-gpu-blocks-override", "256",
                      "--verifier-metrics-port", str(metrics_port),
                      ready_timeout_s=600) as running:
        yield running, metrics_port


def test_mixed_traffic_with_a_drafter_killed_fails_nothing(stack_and_metrics) -> None:
    stack, metrics_port = stack_and_metrics
    (verifier_pid,) = stack.child_pids("verifier_svc")
    warmup = Load(stack.base_url)
    warmup.run(WARMUP_S)
    assert warmup.failures == []
    rss_before = _rss_bytes(verifier_pid)

    load = Load(stack.base_url)
    killer = threading.Timer(SOAK_S / 3, lambda: [os.kill(pid, signal.SIGKILL)
                                                  for pid in stack.child_pids("drafter_svc")])
    drafters_before = stack.child_pids("drafter_svc")
    assert drafters_before
    killer.start()
    load.run(SOAK_S)
    killer.join()
    # The launcher restarted the killed drafter.
    assert stack.child_pids("drafter_svc") and stack.child_pids("drafter_svc") != drafters_before

    deadline = time.monotonic() + 60
    while _metric(metrics_port, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "KV blocks still held after the soak"
        time.sleep(0.5)
    assert _metric(metrics_port, "vllm:num_requests_running") == 0
    rss_after = _rss_bytes(verifier_pid)
    latencies = sorted(load.latencies_s)
    print(f"\nsoak: {SOAK_S:.0f} s at concurrency {CONCURRENCY}: {len(latencies)} requests, "
          f"{len(load.failures)} failures, latency p50 {statistics.median(latencies):.2f} s, "
          f"p99 {latencies[int(0.99 * (len(latencies) - 1))]:.2f} s; verifier RSS "
          f"{rss_before / 2**20:.0f} MiB after warm-up, {rss_after / 2**20:.0f} MiB after")
    assert load.failures == [], load.failures[:10]
    assert len(latencies) >= CONCURRENCY
    assert rss_after <= rss_before * (1 + MEMORY_MARGIN)
