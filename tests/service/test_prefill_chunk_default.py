"""The largest prefill chunk beside running decodes defaults by device: 128 tokens on a CPU
(where a chunk's compute, not the weight read, sets the step's time), 512 on an
accelerator; a value given on the command line is kept; the prefill pacer learns from the
engine's steps (issue 44, item 9)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from specdec.config import (
    ACCELERATOR_LONG_PREFILL_TOKEN_THRESHOLD,
    CPU_LONG_PREFILL_TOKEN_THRESHOLD,
    default_long_prefill_token_threshold,
)
from specdec.config_flags import build_config
from specdec.engine.engine import Engine
from tests.support.engine_harness import generate, greedy, served_engine
from tests.support.tiny_models import make_tiny_llama
from verifier_svc import __main__ as verifier_main
from verifier_svc.builder import VerifierConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-prefill-chunk"))


def test_the_default_is_the_devices() -> None:
    assert default_long_prefill_token_threshold("cpu") == CPU_LONG_PREFILL_TOKEN_THRESHOLD == 128
    for device_type in ("cuda", "npu"):
        assert default_long_prefill_token_threshold(device_type) == ACCELERATOR_LONG_PREFILL_TOKEN_THRESHOLD
    parser = verifier_main.build_parser()
    assert build_config(VerifierConfig, parser.parse_args([])).engine.long_prefill_token_threshold is None
    given = parser.parse_args(["--long-prefill-token-threshold", "0"])
    assert build_config(VerifierConfig, given).engine.long_prefill_token_threshold == 0


@pytest.mark.parametrize(("given", "resolved"), [(None, CPU_LONG_PREFILL_TOKEN_THRESHOLD), (0, 0), (512, 512)])
async def test_the_builder_fills_in_the_cpus_default(tiny_model: Path, given: int | None,
                                                      resolved: int) -> None:
    async with served_engine(tiny_model, None, "cpu", long_prefill_token_threshold=given) as engine:
        assert engine.config.long_prefill_token_threshold == resolved
        assert engine.scheduler.config.long_prefill_token_threshold == resolved


async def _decode_beside_a_long_prompt(tiny_model: Path, decode_steps: float) -> tuple[list[int], list[int], Engine]:
    async with served_engine(tiny_model, None, "cpu", max_model_len=512, max_num_batched_tokens=64,
                             num_kv_blocks=512, long_prefill_token_threshold=32,
                             prefill_chunk_decode_steps=decode_steps) as engine:
        decode = asyncio.create_task(generate(engine, [5, 6, 7, 8], greedy(60)))
        while engine.num_running == 0 or engine.num_steps < 8:  # the decode is under way
            await asyncio.sleep(0.005)
        long_prompt = [(3 + 7 * i) % 90 for i in range(400)]
        answer = await generate(engine, long_prompt, greedy(4))
        return await decode, answer, engine


async def test_the_pacer_learns_from_the_engines_steps_and_changes_no_answer(tiny_model: Path) -> None:
    """The engine tells the scheduler each step's time, so the pacer measures both costs;
    its chunks (which depend on the timings) leave every answer as the token cap's."""
    paced_decode, paced_answer, engine = await _decode_beside_a_long_prompt(tiny_model, 2)
    pacer = engine.scheduler.pacer
    assert pacer.decode_step_s is not None and pacer.prefill_token_s is not None
    capped_decode, capped_answer, engine = await _decode_beside_a_long_prompt(tiny_model, 0)
    assert engine.scheduler.pacer.max_chunk(32) == 32  # off: the cap alone
    assert paced_decode == capped_decode and len(paced_decode) == 60
    assert paced_answer == capped_answer
