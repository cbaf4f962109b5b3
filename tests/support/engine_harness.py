"""The one harness that starts an in-process verifier engine for a test, with a real drafter
service on a loopback port when the test speculates, and drives requests to their end."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from drafter_svc.proposer import ModelOptions
from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.engine.sampling_params import SamplingParams
from verifier_svc.builder import VerifierConfig, build_engine
from specdec.engine.engine import Engine
from verifier_svc.requests import collect_outputs

# Prompts with repeats, so the ngram drafter finds matches.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
    [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 20, 21, 22, 23],
    [40, 41, 40, 41, 40, 41, 40],
]
MAX_TOKENS = 24
# ngram_engine's batch and pool: room for PROMPTS at once, a few blocks each.
SMALL_ENGINE: dict[str, object] = dict(
    max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256,
    draft_timeout_s=1.0)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def ngram_spec(k: int) -> SpeculativeConfig:
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert config is not None
    return config


async def generate(engine: Engine, prompt: list[int], params: SamplingParams,
                   num_speculative_tokens: int | None = None) -> list[int]:
    """The streamed token ids of one request (None: the engine's speculation setting)."""
    _, queue = engine.add_request("test", prompt, params, num_speculative_tokens)
    tokens, _ = await collect_outputs(queue)
    return tokens


@contextlib.asynccontextmanager
async def served_engine(model_dir: Path, spec: dict | SpeculativeConfig | None, device: str, *,
                        drafter_knows_target: bool = True, expect_healthy: bool = True,
                        healthy_timeout_s: float = 5.0, drafter_options: dict[str, object] | None = None,
                        **config: object) -> AsyncIterator[Engine]:
    """A started fp32 engine on `model_dir` drafting with a fixed k, and for `spec` a real
    drafter service on a loopback port; `config` overrides VerifierConfig's fields. Both are
    stopped on exit.

    The drafter is told the target model (as `--target-model` does; `drafter_options` adds to
    its ModelOptions) unless `drafter_knows_target` is false. The engine is yielded once the
    drafter's health is `expect_healthy`, so drafts come from the first step on: a seeded sample
    depends on which drafts came."""
    speculative_config = SpeculativeConfig.parse(spec) if isinstance(spec, dict) else spec
    drafter = None
    targets: tuple[str, ...] = ()
    if speculative_config is not None:
        options = None
        if drafter_knows_target:
            options = ModelOptions(target_model=str(model_dir), dtype="float32", device=device,
                                   num_blocks=256, block_size=4, **(drafter_options or {}))  # type: ignore[arg-type]
        drafter, port = await start_drafter_server(speculative_config, "127.0.0.1", 0,
                                                   options=options)
        targets = (f"127.0.0.1:{port}",)
    values: dict[str, object] = dict(
        model=str(model_dir), device=device, dtype="float32", block_size=4,
        speculative_config=speculative_config, drafter_targets=targets, draft_timeout_s=2.0,
        # Fixed k: these tests need drafts every step; adaptive k has tests of its own.
        adaptive_speculation=False)
    values.update(config)
    engine, _ = build_engine(build_config(VerifierConfig, **values))  # type: ignore[arg-type]
    await engine.start()
    try:
        if drafter is not None:
            healthy = await engine.drafter_pool.wait_for_healthy(1, timeout_s=healthy_timeout_s)
            assert healthy == expect_healthy
        yield engine
    finally:
        await engine.stop()
        if drafter is not None:
            await stop_drafter_server(drafter)


def ngram_engine(model_dir: Path, device: str, k: int | None = None,
                 **overrides: object) -> contextlib.AbstractAsyncContextManager[Engine]:
    """served_engine with the small batch of SMALL_ENGINE, drafting k tokens by ngram (none
    for k None) from a drafter that knows nothing of the target."""
    return served_engine(model_dir, ngram_spec(k) if k else None, device,
                         drafter_knows_target=False, **{**SMALL_ENGINE, **overrides})


async def plain_outputs(model_dir: Path, device: str) -> list[list[int]]:
    """PROMPTS decoded greedily without speculation, one at a time."""
    async with ngram_engine(model_dir, device) as engine:
        return [await generate(engine, prompt, greedy()) for prompt in PROMPTS]

