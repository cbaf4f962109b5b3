"""Driving an in-process verifier engine from tests: one request to its end."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from drafter_svc.proposer import ModelOptions
from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.engine.sampling_params import SamplingParams
from verifier_svc.builder import VerifierConfig, build_engine
from verifier_svc.engine import Engine
from verifier_svc.requests import collect_outputs


async def generate(engine: Engine, prompt: list[int], params: SamplingParams,
                   num_speculative_tokens: int | None = None) -> list[int]:
    """The streamed token ids of one request (None: the engine's speculation setting)."""
    _, queue = engine.add_request("test", prompt, params, num_speculative_tokens)
    tokens, _ = await collect_outputs(queue)
    return tokens


@contextlib.asynccontextmanager
async def served_engine(model_dir: Path, spec: dict | None, device: str,
                        **config: object) -> AsyncIterator[Engine]:
    """A started fp32 engine on `model_dir` drafting with a fixed k, and for `spec` a real
    drafter service on a loopback port (healthy before the engine is yielded); `config`
    overrides VerifierConfig's fields. Both are stopped on exit."""
    speculative_config = SpeculativeConfig.parse(spec) if spec else None
    drafter = None
    targets: tuple[str, ...] = ()
    if speculative_config is not None:
        options = ModelOptions(target_model=str(model_dir), dtype="float32", device=device,
                               num_blocks=256, block_size=4)
        drafter, port = await start_drafter_server(speculative_config, "127.0.0.1", 0,
                                                   options=options)
        targets = (f"127.0.0.1:{port}",)
    values: dict[str, object] = dict(
        model=str(model_dir), device=device, dtype="float32", block_size=4,
        speculative_config=speculative_config, drafter_targets=targets, draft_timeout_s=2.0,
        adaptive_speculation=False)
    values.update(config)
    engine, _ = build_engine(VerifierConfig(**values))  # type: ignore[arg-type]
    await engine.start()
    try:
        if engine.drafter_pool is not None:
            assert await engine.drafter_pool.wait_for_healthy(1, timeout_s=5.0)
        yield engine
    finally:
        await engine.stop()
        if drafter is not None:
            await stop_drafter_server(drafter)
