"""Model drafting methods (draft_model, eagle, eagle3) through the real services on tiny
random targets: the prompts, and one run of them through a drafter and an engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

from specdec.engine.sampling_params import SamplingParams
from tests.support.engine_harness import generate, served_engine
from specdec.engine.engine import Engine

K = 3
NUM_LAYERS = 8  # eagle3's default layers (2, L/2, L-3) are then distinct: (2, 4, 5)
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [30, 31, 32, 30, 31, 32, 33],
    [50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 51, 52, 53],
]
MAX_TOKENS = 20


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


async def serve_and_generate(target: Path, device: str, spec: dict | None,
                             params: SamplingParams | None = None, expect_healthy: bool = True,
                             compile_forward: bool = False,
                             **drafter_options: object) -> tuple[list[list[int]], Engine]:
    """Runs PROMPTS concurrently through an engine (and a drafter for `spec`)."""
    async with served_engine(
            target, spec, device, expect_healthy=expect_healthy, healthy_timeout_s=3.0,
            drafter_options=drafter_options, max_model_len=128, num_kv_blocks=256,
            max_num_batched_tokens=16, compile=compile_forward,
            # Drafts every step: a seeded sample with drafted probabilities depends on which
            # drafts came, and the adaptive policy's choices depend on measured times.
            draft_timeout_s=2.0, adaptive_speculation=False) as engine:
        outputs = await asyncio.gather(*(generate(engine, p, params or greedy()) for p in PROMPTS))
    return list(outputs), engine
