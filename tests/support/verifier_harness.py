"""In-process verifiers on a tiny model for gRPC-level tests, optionally slowed down."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import torch

from specdec.config_flags import build_config
from specdec.v1 import specdec_pb2
from verifier_svc.builder import VerifierConfig
from verifier_svc.server import RunningVerifier, start_verifier

StartVerifier = Callable[..., Awaitable[RunningVerifier]]


def slow_down(verifier: RunningVerifier, step_s: float) -> None:
    """Each forward takes at least `step_s`, so steps can be counted against wall time."""
    execute = verifier.engine.runner.execute

    def slow_execute(*args: object) -> object:
        time.sleep(step_s)
        return execute(*args)

    verifier.engine.runner.execute = slow_execute  # type: ignore[method-assign]


@asynccontextmanager
async def verifier_starter(model: Path, device: torch.device, num_blocks: int,
                           step_s: float | None = None) -> AsyncIterator[StartVerifier]:
    """Yields `start(**config_overrides)`; every verifier it started is stopped on exit."""
    running: list[RunningVerifier] = []

    async def start_one(**overrides: object) -> RunningVerifier:
        values: dict[str, object] = dict(
            model=str(model), device=str(device), dtype="float32", max_model_len=128,
            block_size=4, num_kv_blocks=num_blocks)
        values.update(overrides)
        verifier = await start_verifier(build_config(VerifierConfig, **values), "127.0.0.1", 0)  # type: ignore[arg-type]
        running.append(verifier)
        if step_s is not None:
            slow_down(verifier, step_s)
        return verifier

    try:
        yield start_one
    finally:
        for verifier in running:
            await verifier.stop()


def request(prompt: list[int], max_tokens: int) -> specdec_pb2.GenerateRequest:
    return specdec_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=prompt,
        sampling=specdec_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
