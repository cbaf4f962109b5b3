"""Greedy speculation in bf16 (the CPU default): identical to plain decoding but for near-ties.

docs/architecture.md: in 16-bit dtypes a forward over k + 1 tokens may round differently from a
forward over 1, so a near-tie can flip. Every divergence is reported with the target's
top-two logit gap at that point; a divergence where the gap exceeds bf16's rounding at
that logit's magnitude is a bug.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionMetadata
from specdec.layers.cpu_extension import linear_supports
from specdec.models.compiled_forward import CompiledForward, linears_to_pack, warm_up
from specdec.models.cpu_stack import CPU_STACK_ENV, CpuDecoderStack
from specdec.models.loader import load_model
from specdec.models.model_files import DEFAULT_MODEL, resolve_model
from specdec.models.packed_linear import (
    PackedLinear,
    choose_kernel,
    mkldnn_supported,
    pack_linears,
)
from tests.support.engine_harness import PROMPTS, generate, greedy, ngram_engine
from tests.support.tiny_models import make_tiny_llama


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
    async with ngram_engine(tiny_model, str(device), k=3, dtype="bfloat16") as engine:
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


needs_bf16_kernel = pytest.mark.skipif(not linear_supports(torch.bfloat16),
                                       reason="no AVX512-BF16 linear kernel on this CPU")


def _logits(forward, kv_cache: KVCache, token_ids: list[int], start: int) -> torch.Tensor:
    """One step over `token_ids` at positions start.. of one sequence (blocks 0..)."""
    positions = torch.arange(start, start + len(token_ids))
    block_table = torch.arange(-(-(start + len(token_ids)) // kv_cache.block_size))
    metadata = AttentionMetadata(slot_mapping=positions.clone(), query_start_locs=[0, len(token_ids)],
                                 context_lens=[start + len(token_ids)], block_tables=[block_table])
    return forward.compute_logits(forward(torch.tensor(token_ids), positions, kv_cache, metadata))


@needs_bf16_kernel
@pytest.mark.parametrize("kind", ["eager", "compiled", "stack", "stack-int8"])
@pytest.mark.parametrize("model_name", ["tiny", "default"])
def test_a_verify_window_computes_each_token_as_a_decode_does(tmp_path: Path, kind: str, model_name: str) -> None:
    # The default model too: on it (not on the tiny one) inductor's one-token and
    # many-token bf16 graphs rounded differently before `emulate_precision_casts`.
    if model_name == "tiny":
        model_dir = make_tiny_llama(tmp_path / "wide", hidden_size=128)
    else:
        model_dir = resolve_model(DEFAULT_MODEL)
    model = load_model(model_dir, torch.bfloat16, torch.device("cpu"))
    del model.model.layers[6:]  # enough layers to show the difference (three did not), compiled in ~15 s
    model.config = dataclasses.replace(model.config, num_hidden_layers=len(model.model.layers))
    if kind == "stack-int8" and not linear_supports(torch.bfloat16, int8_weights=True):
        pytest.skip("no int8 kernel without AVX512-VBMI")
    kernel = choose_kernel(torch.device("cpu"), torch.bfloat16, "int8" if kind == "stack-int8" else None)
    pack_linears(model, kernel, only=linears_to_pack(kernel) if kind == "compiled" else None)
    kv_cache = KVCache.allocate(model.config, 8, 16, torch.bfloat16, torch.device("cpu"))
    forward = model
    if kind == "compiled":
        forward = CompiledForward(model)
        warm_up(forward, kv_cache, block_ids=[7])
    elif kind.startswith("stack"):
        forward = CpuDecoderStack(model)
    token_ids = torch.randint(3, model.config.vocab_size, (25,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        _logits(forward, kv_cache, token_ids[:20], 0)
        decoded = torch.cat([_logits(forward, kv_cache, [token], 20 + i) for i, token in enumerate(token_ids[20:])])
        _logits(forward, kv_cache, token_ids[:20], 0)
        verified = _logits(forward, kv_cache, token_ids[20:], 20)
    assert torch.equal(decoded, verified), f"max difference {(decoded - verified).abs().max().item()}"


@needs_bf16_kernel
@pytest.mark.parametrize("kind", ["eager", "compiled", "stack", "stack-int8"])
async def test_bf16_speculation_is_exact_with_the_cpu_kernels(tiny_model: Path, kind: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU specdec's linear and attention kernels are row-invariant, the C++ decoder
    stack computes each row alone and the compiled graphs round as eager does, so a verify
    window computes each of its tokens bit for bit as a one-token decode would: no near-tie
    is left to flip. So too with weight-only int8 (`--quantization int8`) on specdec's kernel:
    speculation reproduces the quantised model's own greedy output."""
    quantization = "int8" if kind == "stack-int8" else None
    if quantization and not linear_supports(torch.bfloat16, int8_weights=True):
        pytest.skip("no int8 kernel without AVX512-VBMI")
    if not kind.startswith("stack"):
        monkeypatch.setenv(CPU_STACK_ENV, "0")
    async with ngram_engine(tiny_model, "cpu", k=3, dtype="bfloat16", compile=kind == "compiled",
                            quantization=quantization) as engine:
        assert isinstance(engine.runner.forward, CpuDecoderStack) == kind.startswith("stack")
        lm_head = engine.runner.model.lm_head
        assert isinstance(lm_head, PackedLinear) and lm_head.kernel == (quantization or "cpu")
        # The quantised tiny model repeats itself (what ngram drafts from) only later.
        params = greedy(96) if quantization else greedy()
        for prompt in PROMPTS:
            plain = await generate(engine, prompt, params, num_speculative_tokens=0)
            assert await generate(engine, prompt, params) == plain
        assert engine.spec.num_accepted_tokens > 0, "ngram never helped"
