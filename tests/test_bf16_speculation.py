"""Greedy speculation in bf16 (the CPU default): identical to plain decoding but for near-ties.

DESIGN.md: in 16-bit dtypes a forward over k + 1 tokens may round differently from a
forward over 1, so a near-tie can flip. Every divergence is reported with the target's
top-two logit gap at that point; a divergence where the gap exceeds bf16's rounding at
that logit's magnitude is a bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.attention import AttentionMetadata
from specdec.models.packed_linear import mkldnn_supported
from tests.engine_driver import generate
from tests.test_engine import PROMPTS, EngineHarness, greedy
from tests.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-bf16"))


def top_two_gap(engine, context: list[int]) -> tuple[float, float]:
    """(top-1 minus top-2 logit, |top-1 logit|) after `context`, from a fresh forward."""
    model, kv_cache = engine.runner.model, engine.runner.kv_cache
    block_size = engine.runner.block_size
    num_tokens = len(context)
    free = engine.scheduler.block_manager.num_free_blocks
    block_table = torch.arange(free - (-(-num_tokens // block_size)), free)  # unused blocks at the end
    positions = torch.arange(num_tokens)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    metadata = AttentionMetadata(slot_mapping=slots, query_start_locs=[0, num_tokens],
                                 context_lens=[num_tokens], block_tables=[block_table])
    with torch.inference_mode():
        hidden = model(torch.tensor(context), positions, kv_cache, metadata)
        top = model.compute_logits(hidden[-1:])[0].topk(2).values
    return float(top[0] - top[1]), float(top[0].abs())


@pytest.mark.skipif(not mkldnn_supported(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
async def test_bf16_divergences_are_near_ties_only(tiny_model: Path, device) -> None:
    async with EngineHarness(tiny_model, str(device), k=3, dtype="bfloat16") as engine:
        divergences = []
        for prompt in PROMPTS:
            plain = await generate(engine, prompt, greedy(), num_speculative_tokens=0)
            speculative = await generate(engine, prompt, greedy())
            if plain == speculative:
                continue
            index = next(i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b)
            gap, magnitude = top_two_gap(engine, prompt + plain[:index])
            divergences.append((index, gap, magnitude))
        assert engine.spec.num_accepted_tokens > 0, "ngram never helped"
    print(f"bf16 divergences (index, top-two gap, |top logit|): {divergences}")
    for index, gap, magnitude in divergences:
        # Two bf16 ulps at the logit's magnitude (8 significant bits).
        assert gap <= 2 * magnitude * 2.0**-7, f"token {index}: gap {gap} is no near-tie"
