"""HTTP clients that vanish, and a verifier that drains, through the launcher's real stack.

The verifier's own metrics port tells how many KV blocks are free, so a test can see that
a disconnect returned every block, and the gateway's /health says which verifier state
it saw.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.served_stack import free_port, served_stack
from tests.support.tiny_models import make_tiny_llama

NUM_BLOCKS = 256
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-http"), max_positions=4096)


def gauges(metrics_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def wait_until_all_blocks_free(metrics_port: int, timeout_s: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = gauges(metrics_port)
        if values["specdec:kv_cache_free_blocks"] == NUM_BLOCKS or time.monotonic() > deadline:
            return values
        time.sleep(0.02)


def long_request(model: Path, stream: bool) -> dict:
    return {"model": str(model), "prompt": "w5 w6 w7 w8", "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True, "stream": stream}


@pytest.fixture(scope="module")
def stack(tiny_model: Path):
    metrics_port = free_port()
    with served_stack(tiny_model, "--max-model-len", "4096", "--block-size", str(BLOCK_SIZE),
                      "--num-gpu-blocks-override", str(NUM_BLOCKS),
                      "--verifier-metrics-port", str(metrics_port)) as running:
        yield running, metrics_port


def test_streaming_client_disconnect_frees_every_block(stack, tiny_model: Path) -> None:
    running, metrics_port = stack
    with httpx.stream("POST", f"{running.base_url}/v1/completions", timeout=30,
                      json=long_request(tiny_model, stream=True)) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert gauges(metrics_port)["specdec:kv_cache_free_blocks"] < NUM_BLOCKS
    values = wait_until_all_blocks_free(metrics_port)
    assert values["specdec:kv_cache_free_blocks"] == NUM_BLOCKS
    assert values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0


def test_non_streaming_client_disconnect_frees_every_block(stack, tiny_model: Path) -> None:
    running, metrics_port = stack
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{running.base_url}/v1/completions", timeout=0.3,
                   json=long_request(tiny_model, stream=False))
    values = wait_until_all_blocks_free(metrics_port)
    assert values["specdec:kv_cache_free_blocks"] == NUM_BLOCKS
    assert values["vllm:num_requests_running"] == 0
    # The service still answers.
    answer = httpx.post(f"{running.base_url}/v1/completions", timeout=30, json={
        "model": str(tiny_model), "prompt": "w5 w6", "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200


def test_health_says_the_verifier_is_draining(tiny_model: Path) -> None:
    with served_stack(tiny_model, "--max-model-len", "4096",
                      "--num-gpu-blocks-override", str(NUM_BLOCKS),
                      "--shutdown-grace-s", "3") as running:
        health = httpx.get(f"{running.base_url}/health", timeout=5).json()
        assert health["status"] == "ok" and list(health["verifiers"].values()) == ["serving"]
        in_flight = threading.Thread(target=lambda: httpx.post(
            f"{running.base_url}/v1/completions", timeout=30,
            json=long_request(tiny_model, stream=False)))
        in_flight.start()
        time.sleep(0.3)
        [verifier] = running.child_pids("verifier_svc")
        os.kill(verifier, signal.SIGTERM)
        deadline = time.monotonic() + 3
        seen = None
        while time.monotonic() < deadline:
            response = httpx.get(f"{running.base_url}/health", timeout=5)
            seen = (response.status_code, response.json())
            if response.status_code == 503:
                break
            time.sleep(0.05)
        assert seen is not None and seen[0] == 503
        # The in-flight request keeps the verifier draining (not_serving), not gone.
        assert list(seen[1]["verifiers"].values()) == ["not_serving"]
        in_flight.join(timeout=30)
