"""The verifier engine on a tiny random model with a real ngram drafter service.

Greedy speculation must give exactly the tokens plain decoding gives, whatever the
batch, the chunking, the pool size or the drafter's health.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import InvalidRequestError
from tests.support.engine_harness import (
    MAX_TOKENS,
    PROMPTS,
    generate,
    greedy,
    ngram_engine,
    ngram_spec,
    plain_outputs,
)
from tests.support.tiny_models import EOS_TOKEN_ID, make_tiny_llama
from verifier_svc.builder import VerifierConfig, build_engine
from verifier_svc.drafting.drafter_pool import DraftRequest
from specdec.engine.step_record import StepRecord
from verifier_svc.speculation import probe_schedule

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def expected(tiny_model: Path, device) -> list[list[int]]:
    return asyncio.run(plain_outputs(tiny_model, str(device)))


@pytest.mark.parametrize("k", [1, 3, 5])
async def test_greedy_invariance_with_ngram(tiny_model: Path, device, expected, k: int) -> None:
    async with ngram_engine(tiny_model, str(device), k=k) as engine:
        outputs = [await generate(engine, prompt, greedy()) for prompt in PROMPTS]
        spec = engine.spec
    assert outputs == expected
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0, "ngram never helped"
    assert all(len(tokens) == MAX_TOKENS for tokens in outputs)


async def test_adaptive_speculation_keeps_outputs(tiny_model: Path, device, expected) -> None:
    async with ngram_engine(tiny_model, str(device), k=3, adaptive_speculation=True) as engine:
        outputs = await asyncio.gather(*(generate(engine, p, greedy()) for p in PROMPTS))
        policy = engine.speculation.policy
        assert policy is not None and policy.verify_cost.has_data
        assert not policy._stats, "finished sequences are forgotten"
    assert list(outputs) == expected


async def test_decode_steps_tell_the_policy_what_drafting_realized(tiny_model: Path, device,
                                                                   expected) -> None:
    """Each decode step reports its sequences, whether it drafted, its tokens and its wall
    time (verifier_svc/speculation/realized.py); steps with a prefill chunk do not."""
    async with ngram_engine(tiny_model, str(device), k=3, adaptive_speculation=True) as engine:
        policy = engine.speculation.policy
        assert policy is not None
        reported: list[tuple[int, bool, int, float]] = []
        observe = policy.observe_step

        def observe_and_note(num_seqs: int, asked: bool, num_tokens: int, seconds: float) -> None:
            reported.append((num_seqs, asked, num_tokens, seconds))
            observe(num_seqs, asked, num_tokens, seconds)

        policy.observe_step = observe_and_note  # type: ignore[method-assign]
        outputs = await asyncio.gather(*(generate(engine, p, greedy()) for p in PROMPTS))
        num_steps = engine.num_steps
    assert list(outputs) == expected
    assert 0 < len(reported) < num_steps  # the prefill steps are not reported
    assert any(asked for _, asked, _, _ in reported)
    for num_seqs, asked, num_tokens, seconds in reported:
        assert 1 <= num_seqs <= len(PROMPTS) and seconds > 0
        # A sequence yields one token a step, more only through accepted drafts.
        assert num_tokens <= num_seqs * (1 + 3) if asked else num_tokens <= num_seqs


async def test_a_text_drafter_is_asked_for_its_cap_and_its_drafts_cut_by_evidence(
        tiny_model: Path, device, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the adaptive policy an ngram drafter asked at all is asked for k; what arrives
    is cut to the policy's evidence_lengths (here: one token less than each draft), and
    the verified drafts' confidences calibrate it. Outputs unchanged."""
    monkeypatch.setattr(probe_schedule, "MAX_PROBE_INTERVAL", 1)  # probes at the back-off
    async with ngram_engine(tiny_model, str(device), k=3, adaptive_speculation=True) as engine:
        policy, pool = engine.speculation.policy, engine.drafter_pool
        assert policy is not None and pool is not None
        asked: list[int] = []
        offered: list[list[int]] = []
        verified: list[int] = []
        propose, lengths, record = pool.propose, policy.evidence_lengths, policy.record_draft

        async def propose_and_note(requests: list[DraftRequest], *args: object) -> object:
            asked.extend(request.num_speculative_tokens for request in requests)
            return await propose(requests, *args)

        def one_less(confidences: list[list[float]], *args: object) -> list[int]:
            offered.append([len(confidence) for confidence in confidences])
            lengths(confidences, *args)  # runs, on the real fit
            return [max(0, len(confidence) - 1) for confidence in confidences]

        def record_and_note(seq_id: int, num_draft_tokens: int, *args: object) -> None:
            verified.append(num_draft_tokens)
            record(seq_id, num_draft_tokens, *args)

        pool.propose = propose_and_note  # type: ignore[method-assign]
        policy.evidence_lengths = one_less  # type: ignore[method-assign]
        policy.record_draft = record_and_note  # type: ignore[method-assign]
        outputs = await asyncio.gather(*(generate(engine, p, greedy()) for p in PROMPTS))
        calibrated = sum(policy.calibration.reached)
    assert list(outputs) == expected
    # The first plan (nothing timed yet) asks everyone for the cap, as do later asks.
    assert asked and set(asked) <= {3, 2, 1} and asked.count(3) >= len(asked) - 2 * len(PROMPTS)
    assert offered and calibrated > 0
    offered_tokens = sorted(length - 1 for step in offered for length in step if length > 1)
    assert sorted(length for length in verified if length) == offered_tokens


async def test_a_prompt_reaches_the_drafter_as_its_prefill_starts(tiny_model: Path, device,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A new sequence's prompt is sent to the drafter (no drafts asked) in its first step,
    so the drafter takes it in while the verifier prefills, and the sequence's first ask
    carries only the tokens verified since: a steady round trip, timed as one. Probes wait
    out their back-off only here (no wait priced beyond it), so that the tiny model, whose
    step is cheaper than a round trip, still asks after drafting stopped."""
    monkeypatch.setattr(probe_schedule, "MAX_PROBE_INTERVAL", 1)  # no priced wait
    async with ngram_engine(tiny_model, str(device), k=3, adaptive_speculation=True) as engine:
        policy, pool = engine.speculation.policy, engine.drafter_pool
        assert policy is not None and pool is not None
        timed: list[float] = []
        first_asks: list[int] = []
        synced: list[int] = []
        asked_context: list[int] = []
        observe, observe_first = policy.observe_drafting, policy.observe_first_asks
        propose, sync = pool.propose, pool.sync

        def observe_and_note(max_draft_tokens: int, seconds: float) -> None:
            timed.append(seconds)
            observe(max_draft_tokens, seconds)

        def observe_first_and_note(num_first_asks: int, max_draft_tokens: int, seconds: float) -> None:
            first_asks.append(num_first_asks)
            observe_first(num_first_asks, max_draft_tokens, seconds)

        def sync_and_note(requests: list[DraftRequest]) -> None:
            synced.extend(len(request.token_ids) for request in requests)
            assert all(request.num_speculative_tokens == 0 for request in requests)
            sync(requests)

        async def propose_and_note(requests: list[DraftRequest], *args: object) -> object:
            asked_context.extend(len(request.token_ids) for request in requests)
            return await propose(requests, *args)

        policy.observe_drafting = observe_and_note  # type: ignore[method-assign]
        policy.observe_first_asks = observe_first_and_note  # type: ignore[method-assign]
        pool.sync = sync_and_note  # type: ignore[method-assign]
        pool.propose = propose_and_note  # type: ignore[method-assign]
        prompts = PROMPTS[:2]
        for prompt in prompts:
            await generate(engine, prompt, greedy())
    assert synced == [len(prompt) for prompt in prompts]  # each prompt once, whole
    assert asked_context and min(asked_context) > min(synced)  # asks come after the prefill
    assert first_asks == [] and len(timed) > 0  # every ask a steady round trip


async def test_concurrent_batch_equals_one_at_a_time(tiny_model: Path, device, expected) -> None:
    async with ngram_engine(tiny_model, str(device), k=3, max_num_batched_tokens=16) as engine:
        outputs = await asyncio.gather(*(generate(engine, p, greedy()) for p in PROMPTS))
        assert engine.scheduler.block_manager.num_free_blocks == 256
    assert list(outputs) == expected


async def test_preemption_under_a_small_pool_keeps_outputs(tiny_model: Path, device, expected) -> None:
    # 14 blocks of 4 tokens: the four sequences (up to 42 tokens each) cannot all fit.
    async with ngram_engine(tiny_model, str(device), k=3, num_kv_blocks=14,
                            max_model_len=56) as engine:
        outputs = await asyncio.gather(*(generate(engine, p, greedy()) for p in PROMPTS))
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.block_manager.num_free_blocks == 14
    assert list(outputs) == expected


async def test_dead_drafter_costs_speed_not_output(tiny_model: Path, device, expected) -> None:
    # Nothing listens on the drafter address: every step decodes one token.
    async with ngram_engine(tiny_model, str(device), max_model_len=256,
                            speculative_config=ngram_spec(3),
                            drafter_targets=("127.0.0.1:1",), draft_timeout_s=0.01) as engine:
        outputs = [await generate(engine, prompt, greedy()) for prompt in PROMPTS]
        assert engine.spec.num_draft_tokens == 0
    assert outputs == expected


async def test_speculation_override_per_request(tiny_model: Path, device, expected) -> None:
    async with ngram_engine(tiny_model, str(device), k=3) as engine:
        output = await generate(engine, PROMPTS[0], greedy(), num_speculative_tokens=0)
        assert engine.spec.num_drafts == 0
    assert output == expected[0]


@pytest.mark.parametrize("adaptive", [False, True])
async def test_speculation_switched_off_for_the_engine(tiny_model: Path, device, expected,
                                                       adaptive: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched off, no step drafts (nor probes) for any request; switched on again, the same
    requests draft; every step is reported to the listener with the switch's state. Probes
    wait out their back-off only (the tiny model's step is cheaper than a round trip, so
    priced waits would outlast these short requests)."""
    monkeypatch.setattr(probe_schedule, "MAX_PROBE_INTERVAL", 1)
    async with ngram_engine(tiny_model, str(device), k=3, adaptive_speculation=adaptive) as engine:
        records: list[StepRecord] = []
        engine.step_listener = records.append
        engine.speculation_enabled = False
        off = await asyncio.gather(*(generate(engine, p, greedy()) for p in PROMPTS))
        assert engine.spec.num_drafts == 0
        engine.speculation_enabled = True
        on = await asyncio.gather(*(generate(engine, p, greedy()) for p in PROMPTS))
        assert engine.spec.num_drafts > 0
    assert list(off) == expected and list(on) == expected
    assert len(records) == engine.num_steps
    off_steps = [r for r in records if not r.speculation_enabled]
    on_steps = [r for r in records if r.speculation_enabled]
    assert off_steps and on_steps and off_steps[-1].finished <= on_steps[0].started
    assert all(r.num_draft_slots == 0 for r in off_steps) and any(r.num_draft_slots for r in on_steps)
    # Probes are one draft token each, among the step's slots; none while switched off.
    assert all(r.num_probes <= r.num_draft_slots for r in records) and not any(r.num_probes for r in off_steps)
    # Every output token is counted once: the prompt's first sampled token at its last chunk.
    assert sum(r.num_output_tokens for r in off_steps) == sum(r.num_output_tokens for r in on_steps) \
        == len(PROMPTS) * MAX_TOKENS
    assert all(r.num_prefill_tokens > 0 for r in records[:1]) and all(
        r.started <= r.finished and 1 <= r.num_sequences <= len(PROMPTS) for r in records)


SHORT = 6


async def run_two_short_two_long(tiny_model: Path, device, adaptive: bool, **spec_fields: object,
                                 ) -> tuple[list[list[int]], list[StepRecord]]:
    """Four greedy requests on ngram k=3, the first two SHORT tokens long: the outputs and
    each step's record (four running, then two)."""
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                    "prompt_lookup_max": 3, **spec_fields})
    async with ngram_engine(tiny_model, str(device), k=3, speculative_config=spec,
                            adaptive_speculation=adaptive) as engine:
        records: list[StepRecord] = []
        engine.step_listener = records.append
        outputs = await asyncio.gather(*(generate(engine, prompt, greedy(SHORT if index < 2 else MAX_TOKENS))
                                         for index, prompt in enumerate(PROMPTS)))
    return list(outputs), records


@pytest.mark.parametrize("adaptive", [False, True])
async def test_a_batch_above_disable_by_batch_size_drafts_nothing(tiny_model: Path, device, expected,
                                                                adaptive: bool) -> None:
    """vLLM's disable_by_batch_size: while more than two requests run, no step drafts (nor
    probes); once the short requests end, the two long ones draft again. Outputs unchanged."""
    outputs, records = await run_two_short_two_long(tiny_model, device, adaptive, disable_by_batch_size=2)
    assert outputs == [expected[0][:SHORT], expected[1][:SHORT], expected[2], expected[3]]
    assert all(r.num_draft_slots == 0 for r in records if r.num_sequences > 2)
    assert any(r.num_draft_slots for r in records if r.num_sequences <= 2)


@pytest.mark.parametrize("adaptive", [False, True])
async def test_num_speculative_tokens_per_batch_size_caps_each_steps_drafts(
        tiny_model: Path, device, expected, adaptive: bool) -> None:
    """vLLM's table: batches of 3-8 draft nothing, of 1-2 at most one token per request (a
    cap for the adaptive policy, exactly that for the fixed one). Outputs unchanged."""
    outputs, records = await run_two_short_two_long(
        tiny_model, device, adaptive, num_speculative_tokens_per_batch_size=[[3, 8, 0], [1, 2, 1]])
    assert outputs == [expected[0][:SHORT], expected[1][:SHORT], expected[2], expected[3]]
    assert all(r.num_draft_slots == 0 for r in records if r.num_sequences > 2)
    assert all(r.num_draft_slots <= r.num_sequences for r in records)
    assert any(r.num_draft_slots for r in records if r.num_sequences <= 2)


async def test_seeded_sampling_is_reproducible(tiny_model: Path, device) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1234, max_tokens=16,
                            ignore_eos=True)
    async with ngram_engine(tiny_model, str(device), k=3) as engine:
        first = await generate(engine, PROMPTS[1], params)
        second = await generate(engine, PROMPTS[1], params)
        other = await generate(engine, PROMPTS[1], SamplingParams(
            temperature=0.8, top_p=0.9, top_k=20, seed=4321, max_tokens=16, ignore_eos=True))
    assert first == second
    assert len(first) == 16 and first != other


async def test_stop_token_ids_and_eos(tiny_model: Path, device, expected) -> None:
    stop_id = expected[0][5]
    cut = expected[0].index(stop_id)
    async with ngram_engine(tiny_model, str(device), k=3) as engine:
        seq_id, queue = engine.add_request(
            "s", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                            stop_token_ids=(stop_id,)))
        tokens, last = [], None
        while last is None or last.finish_reason is None:
            last = await queue.get()
            tokens.extend(last.token_ids)
    assert tokens == expected[0][:cut]
    assert last.finish_reason.value == "stop"
    assert last.num_output_tokens == cut + 1  # the stop token counts, is not streamed
    assert EOS_TOKEN_ID in engine.eos_token_ids


async def test_abort_frees_blocks(tiny_model: Path, device) -> None:
    async with ngram_engine(tiny_model, str(device), k=3) as engine:
        seq_id, queue = engine.add_request("a", PROMPTS[2], greedy(max_tokens=200))
        await queue.get()
        assert engine.scheduler.block_manager.num_free_blocks < 256
        engine.abort(seq_id)
        assert engine.scheduler.block_manager.num_free_blocks == 256
        assert not engine.scheduler.has_work()


@pytest.mark.parametrize("prompt,params,param", [
    ([], greedy(), "prompt"),
    ([5, 10_000], greedy(), "prompt"),
    (list(range(3, 90)) * 3, greedy(), "prompt"),
    ([5, 6], greedy(max_tokens=255), "max_tokens"),
])
async def test_invalid_requests_are_refused(tiny_model: Path, device, prompt, params, param) -> None:
    async with ngram_engine(tiny_model, str(device)) as engine:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("bad", prompt, params)
        assert info.value.param == param
        # The engine still serves.
        assert len(await generate(engine, PROMPTS[0], greedy(max_tokens=4))) == 4


def test_kv_pool_is_sized_from_the_memory_budget(tiny_model: Path, device) -> None:
    from specdec.engine.kv_cache import KVCache
    from specdec.errors import ConfigError
    from specdec.models.loader import load_model_config

    model_config = load_model_config(tiny_model)
    per_block = KVCache.bytes_per_block(model_config, 4, torch.float32)
    config = build_config(VerifierConfig, model=str(tiny_model), device=str(device), dtype="float32",
                          max_model_len=64, max_num_seqs=64, block_size=4,
                          kv_cache_memory_bytes=100 * per_block + per_block // 2)
    engine, _ = build_engine(config)
    assert engine.scheduler.block_manager.num_blocks == 100
    assert engine.runner.kv_cache.num_blocks == 100
    # Capped at what the limits can ever use: 2 sequences x 16 blocks.
    engine, _ = build_engine(build_config(VerifierConfig, model=str(tiny_model), device=str(device),
                                          dtype="float32", max_model_len=64, max_num_seqs=2,
                                          block_size=4, kv_cache_memory_bytes=100 * per_block))
    assert engine.scheduler.block_manager.num_blocks == 32
    with pytest.raises(ConfigError) as info:
        build_engine(build_config(VerifierConfig, model=str(tiny_model), device=str(device), dtype="float32",
                                  max_model_len=64, block_size=4,
                                  kv_cache_memory_bytes=10 * per_block))
    assert info.value.param == "max_model_len"


async def test_seeded_sample_does_not_depend_on_speculation(tiny_model: Path, device) -> None:
    """One draw per emitted token: the drafts (or their absence) never change a seeded
    request's tokens."""
    async with ngram_engine(tiny_model, str(device), k=3) as engine:
        for seed in (1, 2, 3):
            params = SamplingParams(temperature=0.7, top_p=0.95, seed=seed, max_tokens=24,
                                    ignore_eos=True)
            plain = [await generate(engine, prompt, params, num_speculative_tokens=0)
                     for prompt in PROMPTS]
            speculative = [await generate(engine, prompt, params) for prompt in PROMPTS]
            assert speculative == plain
        assert engine.spec.num_accepted_tokens > 0
