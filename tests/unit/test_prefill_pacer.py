"""The prefill pacer: a decoding step's prefill chunk sized in measured time, not tokens."""

from __future__ import annotations

import pytest

from specdec.config import EngineConfig
from specdec.engine.block_manager import BlockManager
from specdec.engine.prefill_pacer import MIN_PACED_CHUNK, PrefillPacer
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import FinishReason, Sequence
from specdec.errors import ConfigError
from specdec.engine.sampling_params import SamplingParams


def make_seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(range(prompt_len)),
                    prompt_len=prompt_len, params=SamplingParams(max_tokens=64),
                    max_speculative_tokens=0)


def test_until_both_costs_are_measured_the_token_cap_alone_applies() -> None:
    pacer = PrefillPacer(decode_steps=4)
    assert pacer.max_chunk(128) == 128
    pacer.observe(0.020, 0, decoded=True)
    assert pacer.max_chunk(128) == 128  # the prefill cost is still unknown


def test_a_cpu_like_cost_ratio_gives_chunks_of_a_few_decode_steps() -> None:
    """20 ms a decode step, 3 ms a prompt token (a CPU): 3 decode steps' time of prefill
    is 20 tokens, well under the token cap."""
    pacer = PrefillPacer(decode_steps=4)
    pacer.observe(0.020, 0, decoded=True)
    pacer.observe(0.020 + 64 * 0.003, 64, decoded=True)
    assert pacer.decode_step_s == pytest.approx(0.020)
    assert pacer.prefill_token_s == pytest.approx(0.003)
    assert pacer.max_chunk(128) == 20
    # An accelerator-like ratio (a prompt token ~1/200 of a decode step) meets the cap.
    fast = PrefillPacer(decode_steps=4)
    fast.observe(0.010, 0, decoded=True)
    fast.observe(0.010 + 512 * 0.00005, 512, decoded=True)
    assert fast.max_chunk(512) == 512


def test_a_prefill_alone_counts_all_its_time_and_load_cancels_out() -> None:
    pacer = PrefillPacer(decode_steps=3)
    pacer.observe(0.5, 100, decoded=False)  # no decode part to take away
    assert pacer.prefill_token_s == pytest.approx(0.005)
    pacer.observe(0.05, 0, decoded=True)
    assert pacer.max_chunk(1000) == 20
    # The same ratio on a machine twice as slow (others' load) gives the same chunk.
    slow = PrefillPacer(decode_steps=3)
    slow.observe(1.0, 100, decoded=False)
    slow.observe(0.10, 0, decoded=True)
    assert slow.max_chunk(1000) == 20


def test_the_paced_chunk_has_a_floor_and_follows_the_costs() -> None:
    pacer = PrefillPacer(decode_steps=2)
    pacer.observe(0.010, 0, decoded=True)
    pacer.observe(0.010 + 10 * 0.010, 10, decoded=True)  # a prompt token costs a decode step
    assert pacer.max_chunk(128) == MIN_PACED_CHUNK
    assert pacer.max_chunk(4) == 4  # never above the cap, even at the floor
    for _ in range(40):  # prompt tokens grow cheap: the moving average follows
        pacer.observe(0.010 + 100 * 0.0001, 100, decoded=True)
    assert pacer.max_chunk(128) == pytest.approx(100, abs=2)
    off = PrefillPacer(decode_steps=0)
    off.observe(0.010, 0, decoded=True)
    off.observe(0.5, 100, decoded=True)
    assert off.max_chunk(128) == 128


def test_the_scheduler_paces_only_steps_that_decode() -> None:
    """After measured steps the scheduler gives a decoding step's prompt the paced chunk;
    a prompt prefilled alone still takes the whole budget."""
    config = EngineConfig(max_model_len=1024, max_num_batched_tokens=256, block_size=4,
                          num_kv_blocks=512, long_prefill_token_threshold=128)
    scheduler = Scheduler(config, BlockManager(512, 4))
    alone = make_seq(0, 600)
    scheduler.add(alone)
    (item,) = scheduler.schedule(lambda seq: 0).scheduled
    assert item.num_query_tokens == 256
    alone.num_computed_tokens += 256
    scheduler.observe_step(256 * 0.003)  # a prefill alone: 3 ms a token
    assert scheduler.pacer.prefill_token_s == pytest.approx(0.003)
    decoding = make_seq(1, 3)
    scheduler.add(decoding)
    plan = scheduler.schedule(lambda seq: 0)
    for item in plan.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_query_tokens
        if samples:
            item.seq.token_ids.append(7)
    scheduler.finish(alone, FinishReason.ABORT)
    plan = scheduler.schedule(lambda seq: 0)  # the decode alone
    assert [(i.seq.seq_id, i.num_query_tokens) for i in plan.scheduled] == [(1, 1)]
    decoding.num_computed_tokens += 1
    decoding.token_ids.append(7)
    scheduler.observe_step(0.020)
    assert scheduler.pacer.decode_step_s == pytest.approx(0.020)
    scheduler.add(make_seq(2, 500))
    plan = scheduler.schedule(lambda seq: 0)
    # 3 decode steps' time (60 ms) at 3 ms a token: 20 tokens beside the decode.
    assert [(i.seq.seq_id, i.num_query_tokens) for i in plan.scheduled] == [(1, 1), (2, 20)]




def test_a_pace_below_one_decode_step_is_refused() -> None:
    with pytest.raises(ConfigError) as raised:
        EngineConfig(max_model_len=64, prefill_chunk_decode_steps=0.5)
    assert raised.value.param == "prefill_chunk_decode_steps"
    EngineConfig(max_model_len=64, prefill_chunk_decode_steps=0)
