"""Scheduler: batching limits, chunked prefill, draft slots, preemption, freeing."""

from __future__ import annotations

import pytest

from specdec.config import EngineConfig
from specdec.engine.block_manager import BlockManager
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import FinishReason, Sequence, SequenceStatus
from specdec.errors import ConfigError


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64,
                   long_prefill_token_threshold: int = 0) -> Scheduler:
    config = EngineConfig(max_model_len=1024, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                          num_kv_blocks=num_blocks,
                          long_prefill_token_threshold=long_prefill_token_threshold)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def make_seq(seq_id: int, prompt_len: int, max_spec: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(range(prompt_len)),
                    prompt_len=prompt_len, params=SamplingParams(max_tokens=16),
                    max_speculative_tokens=max_spec)


def no_drafts(seq: Sequence) -> int:
    return 0


def finish_step(scheduler: Scheduler, new_tokens: int = 1) -> None:
    """What the engine does after a forward: chunks computed, sampled tokens appended."""
    plan = scheduler.schedule(no_drafts)
    for item in plan.scheduled:
        if item.samples:
            item.seq.num_computed_tokens += item.num_query_tokens
            item.seq.token_ids.extend([7] * new_tokens)
        else:
            item.seq.num_computed_tokens += item.num_query_tokens


def test_admits_up_to_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add(make_seq(i, 5))
    plan = scheduler.schedule(no_drafts)
    assert [s.seq.seq_id for s in plan.scheduled] == [0, 1]
    assert len(scheduler.waiting) == 1
    assert all(s.samples for s in plan.scheduled)


def test_chunked_prefill_respects_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq(0, 40)
    scheduler.add(seq)
    chunks = []
    while seq.num_computed_tokens < 40:
        plan = scheduler.schedule(no_drafts)
        (item,) = plan.scheduled
        chunks.append((item.num_query_tokens, item.samples))
        seq.num_computed_tokens += item.num_query_tokens
    assert chunks == [(16, False), (16, False), (8, True)]


def test_decode_and_prefill_share_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    decoding = make_seq(0, 3, max_spec=4)
    scheduler.add(decoding)
    finish_step(scheduler)  # prefill, one token sampled: now in decode
    scheduler.add(make_seq(1, 30))
    plan = scheduler.schedule(lambda seq: seq.max_speculative_tokens)
    first, second = plan.scheduled
    assert (first.seq.seq_id, first.num_query_tokens, first.num_speculative_tokens) == (0, 1, 4)
    assert (second.seq.seq_id, second.num_query_tokens, second.samples) == (1, 5, False)
    assert plan.num_tokens == 10
    # Slots for the token and its 4 drafts are reserved: 4 + 4 = 8 slots -> 2 blocks.
    assert len(decoding.block_table) == 2


def test_drafts_dropped_before_anyone_is_preempted() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    seq = make_seq(0, 4, max_spec=4)
    scheduler.add(seq)
    finish_step(scheduler)  # 5 tokens, 4 computed
    for _ in range(3):  # fill the second block: 8 tokens, 7 computed
        plan = scheduler.schedule(no_drafts)
        seq.num_computed_tokens += 1
        seq.token_ids.append(1)
    plan = scheduler.schedule(lambda s: 4)  # 7 + 1 + 4 slots > 8 available
    (item,) = plan.scheduled
    assert item.num_speculative_tokens == 0 and not plan.preempted


def test_preempts_youngest_when_pool_runs_out_and_recomputes() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    old, young = make_seq(0, 8), make_seq(1, 8)
    scheduler.add(old)
    scheduler.add(young)
    finish_step(scheduler)  # both prefilled: 9 tokens each, 8 computed, 2 blocks each
    assert scheduler.block_manager.num_free_blocks == 0
    finish_step(scheduler)  # old needs a 3rd block -> young is preempted
    assert young.status is SequenceStatus.WAITING and young.num_computed_tokens == 0
    assert young.block_table == [] and scheduler.num_preemptions == 1
    assert scheduler.running == [old]
    scheduler.finish(old, FinishReason.STOP)
    plan = scheduler.schedule(no_drafts)  # young comes back, recomputing all its tokens
    (item,) = plan.scheduled
    assert item.seq is young and item.num_query_tokens == young.num_tokens and item.samples


def test_finish_and_cancel_free_blocks_no_leak() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    seqs = [make_seq(i, 3 + i) for i in range(6)]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(4):
        finish_step(scheduler)
    scheduler.finish(seqs[0], FinishReason.ABORT)     # cancelled while running
    scheduler.finish(seqs[0], FinishReason.ABORT)     # twice is harmless
    for seq in seqs[1:]:
        scheduler.finish(seq, FinishReason.STOP)
    assert scheduler.block_manager.num_free_blocks == 32
    assert not scheduler.has_work()


def test_cancel_while_waiting() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq(0, 4), make_seq(1, 4)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule(no_drafts)
    scheduler.finish(waiting, FinishReason.ABORT)
    assert list(scheduler.waiting) == [] and waiting.finish_reason is FinishReason.ABORT


def test_a_long_prefill_never_holds_up_decodes_or_a_short_request() -> None:
    """Issue 44 item 9: counted in steps. While a long prompt prefills in chunks, a decode
    gets a token every step, and a short request that arrives meanwhile starts at once."""
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=32)
    decoding = make_seq(0, 3)
    scheduler.add(decoding)
    finish_step(scheduler)
    long_prompt = make_seq(1, 600)
    scheduler.add(long_prompt)
    finish_step(scheduler)  # the long prompt's first chunk
    short = make_seq(2, 4)
    scheduler.add(short)
    steps = 0
    while long_prompt.num_computed_tokens < long_prompt.prompt_len:
        plan = scheduler.schedule(no_drafts)
        ids = [item.seq.seq_id for item in plan.scheduled]
        assert ids[0] == 0  # the decode, every step
        if steps == 0:
            assert ids == [0, 2, 1]  # the short request is admitted next step
        assert plan.num_tokens <= 32
        for item in plan.scheduled:
            samples = item.samples
            item.seq.num_computed_tokens += item.num_query_tokens
            if samples:
                item.seq.token_ids.append(7)
        steps += 1
    assert short.num_output_tokens == steps and decoding.num_output_tokens == steps + 2


def test_a_step_that_decodes_caps_its_prefill_chunks() -> None:
    """With decodes in the step, a prefill chunk is at most long_prefill_token_threshold
    tokens (the step stays short, so does the decode's time between tokens); alone, a
    prompt takes the whole budget."""
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64,
                               long_prefill_token_threshold=16)
    alone = make_seq(0, 200)
    scheduler.add(alone)
    (item,) = scheduler.schedule(no_drafts).scheduled
    assert item.num_query_tokens == 64
    scheduler.finish(alone, FinishReason.ABORT)
    decoding = make_seq(1, 3)
    scheduler.add(decoding)
    finish_step(scheduler)
    scheduler.add(make_seq(2, 200))
    scheduler.add(make_seq(3, 100))
    for _ in range(3):
        plan = scheduler.schedule(no_drafts)
        assert [(i.seq.seq_id, i.num_query_tokens) for i in plan.scheduled] == \
            [(1, 1), (2, 16), (3, 16)]
        for item in plan.scheduled:
            samples = item.samples
            item.seq.num_computed_tokens += item.num_query_tokens
            if samples:
                item.seq.token_ids.append(7)
    with pytest.raises(ConfigError):
        EngineConfig(max_model_len=64, long_prefill_token_threshold=-1)
