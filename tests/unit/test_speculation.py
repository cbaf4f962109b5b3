"""The engine's speculation collaborator on its own, with a stand-in drafter pool: what each
implementation plans, which drafts it hands the forward, and what the adaptive one learns
from a step's record."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine.adaptive_speculation import AdaptiveSpeculation
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.scheduler import ScheduledSequence
from specdec.engine.sequence import FinishReason, Sequence, SequenceStatus
from specdec.engine.speculation import NO_DRAFT, FixedSpeculation, Speculation
from specdec.engine.step_record import StepRecord, StepTally, VerifyRecord
from specdec.errors import InvalidRequestError
from verifier_svc.drafting.drafter_pool import Draft, DraftRequest
from verifier_svc.grammar.verification import NoGrammarService
from verifier_svc.sequence_faults import SequenceFaults

K = 4


class StandInPool:
    """Proposes `draft` for every sequence asked; can abort a sequence while it answers."""

    hidden_state_layer_ids: tuple[int, ...] | None = ()

    def __init__(self, draft: list[int], abort_while_answering: Sequence | None = None) -> None:
        self.draft = draft
        self.abort_while_answering = abort_while_answering
        self.asked: list[DraftRequest] = []
        self.told_finished: list[int] = []
        self.finished_outputs: list[int] = []

    def num_healthy(self) -> int:
        return 1

    async def propose(self, requests: list[DraftRequest], finished: list[int],
                      timeout_s: float) -> dict[int, Draft]:
        self.asked.extend(requests)
        self.told_finished.extend(finished)
        if self.abort_while_answering is not None:
            self.abort_while_answering.status = SequenceStatus.FINISHED
            self.abort_while_answering.finish_reason = FinishReason.ABORT
        return {request.seq_id: Draft(token_ids=self.draft[:request.num_speculative_tokens],
                                      probs=None, confidence=[0.9] * len(self.draft))
                for request in requests}

    def sync(self, requests: list[DraftRequest]) -> None:
        pass

    def record_finished_output(self, seq_id: int, prompt: list[int], output: list[int]) -> None:
        self.finished_outputs.append(seq_id)


def decoding(seq_id: int, *, max_tokens: int = 32, max_speculative_tokens: int = K) -> Sequence:
    """A sequence in decode: its prompt computed, one new token to verify."""
    seq = Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=[1, 2, 3, 4, 5],
                   prompt_len=4, params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   max_speculative_tokens=max_speculative_tokens)
    seq.num_computed_tokens = 4
    seq.status = SequenceStatus.RUNNING
    return seq


def speculation(kind: type[FixedSpeculation], pool: StandInPool, **config: Any) -> FixedSpeculation:
    failed: list[Sequence] = []
    return kind(EngineConfig(max_model_len=64, num_kv_blocks=8, draft_timeout_s=1.0, **config), pool, K,  # type: ignore[arg-type]
                NoGrammarService(), SequenceFaults(lambda seq, error: failed.append(seq)),
                hidden_size=8, dtype=torch.float32)


def test_without_drafters_nothing_is_planned_or_drafted() -> None:
    none = Speculation()
    seqs = [decoding(0), decoding(1)]
    assert [none.plan(seqs)(seq) for seq in seqs] == [0, 0]
    scheduled = [ScheduledSequence(seq, 1) for seq in seqs]
    drafted = asyncio.run(none.draft(scheduled))
    assert drafted.scheduled == scheduled and drafted.drafts == [NO_DRAFT, NO_DRAFT]
    assert drafted.round_trip_s is None and none.hidden_layer_ids == ()


def test_fixed_plans_each_cap_within_the_room_left() -> None:
    fixed = speculation(FixedSpeculation, StandInPool([7, 8, 9, 10]))
    seqs = [decoding(0), decoding(1, max_speculative_tokens=2), decoding(2, max_tokens=3),
            decoding(3, max_speculative_tokens=0)]
    plan = fixed.plan(seqs)
    # room: max_tokens - outputs so far (1) - the token verified anyway (1)
    assert [plan(seq) for seq in seqs] == [K, 2, 1, 0]
    fixed.enabled = False
    assert [fixed.plan(seqs)(seq) for seq in seqs] == [0, 0, 0, 0]


def test_a_batch_past_disable_by_batch_size_drafts_nothing() -> None:
    fixed = speculation(FixedSpeculation, StandInPool([7]), disable_by_batch_size=1)
    seqs = [decoding(0), decoding(1)]
    assert [fixed.plan(seqs)(seq) for seq in seqs] == [0, 0]
    assert fixed.plan(seqs[:1])(seqs[0]) == K


def test_drafts_are_cut_to_their_slots_and_an_aborted_sequence_leaves_the_step() -> None:
    seqs = [decoding(0), decoding(1), decoding(2)]
    pool = StandInPool([7, 8, 9, 10], abort_while_answering=seqs[1])
    fixed = speculation(FixedSpeculation, pool)
    scheduled = [ScheduledSequence(seqs[0], 1, 2), ScheduledSequence(seqs[1], 1, 3),
                 ScheduledSequence(seqs[2], 1, 0)]
    drafted = asyncio.run(fixed.draft(scheduled))
    assert [item.seq.seq_id for item in drafted.scheduled] == [0, 2]
    assert [draft.token_ids for draft in drafted.drafts] == [[7, 8], []]
    assert [request.seq_id for request in pool.asked] == [0, 1]  # not the one with no slots
    assert drafted.round_trip_s is not None and drafted.answered > 0


def test_acceptance_is_counted_per_sequence_and_engine_wide() -> None:
    fixed = speculation(FixedSpeculation, StandInPool([7]))
    seq = decoding(0)
    fixed.record(ScheduledSequence(seq, 1, 3), Draft(token_ids=[7, 8, 9], probs=None), 2)
    fixed.record(ScheduledSequence(seq, 1, 2), Draft(token_ids=[5, 6], probs=None, forced=True), 2)
    assert (seq.spec.num_drafts, seq.spec.num_accepted_tokens, seq.spec.num_forced_tokens) == (1, 2, 2)
    assert fixed.counters.num_draft_tokens == 3 and fixed.counters.num_forced_tokens == 2
    assert seq.num_last_accepted == 0  # the forced draft was the grammar's, not the drafter's


def test_a_finished_sequence_is_told_to_the_drafters_with_the_next_ask() -> None:
    pool = StandInPool([7])
    adaptive = speculation(AdaptiveSpeculation, pool)
    done = decoding(5)
    adaptive.finished(done)
    assert pool.finished_outputs == [5]
    adaptive.forget(6)  # aborted
    asyncio.run(adaptive.draft([ScheduledSequence(decoding(0), 1, 1)]))
    assert pool.told_finished == [5, 6]
    asyncio.run(adaptive.draft([ScheduledSequence(decoding(0), 1, 1)]))
    assert pool.told_finished == [5, 6]  # told once


def record(**fields: Any) -> StepRecord:
    base: dict[str, Any] = dict(started=1.0, finished=1.5, speculation_enabled=True,
                                num_sequences=2, num_prefill_tokens=0, num_draft_slots=4,
                                num_output_tokens=5, num_drafting=2, plain_decode=True,
                                verify=VerifyRecord(6, 2, 0.25, True))
    return StepRecord(**(base | fields))


@pytest.mark.parametrize("fields, observes_step, observes_verify", [
    ({}, True, True),
    ({"num_probes": 2}, False, True),            # only the policy's probes drafted
    ({"num_probes": 1}, True, True),
    ({"num_drafting": 0, "num_draft_slots": 0}, True, True),
    ({"plain_decode": False}, False, True),      # a prefill chunk or a forced draft
    ({"verify": VerifyRecord(9, 1, 0.3, False)}, True, False),
    ({"verify": None}, True, False),             # every sequence ended before the forward
])
def test_the_policy_learns_from_the_steps_that_measure_what_it_plans(
        fields: dict[str, Any], observes_step: bool, observes_verify: bool) -> None:
    adaptive = speculation(AdaptiveSpeculation, StandInPool([7]))
    steps: list[tuple[Any, ...]] = []
    verifies: list[tuple[Any, ...]] = []
    policy = adaptive.policy
    assert policy is not None
    policy.observe_step = lambda *args: steps.append(args)  # type: ignore[method-assign]
    policy.observe_verify = lambda *args: verifies.append(args)  # type: ignore[method-assign]
    step = record(**fields)
    adaptive.observe(step)
    assert steps == ([(step.num_sequences, step.num_drafting > 0, 5, 0.5)] if observes_step else [])
    assert verifies == ([(6, 2, 0.25)] if observes_verify else [])


def test_a_step_tally_counts_what_was_scheduled_and_appended() -> None:
    prefill = Sequence(seq_id=9, request_id="p", token_ids=list(range(10)), prompt_len=10,
                       params=SamplingParams(max_tokens=4), max_speculative_tokens=0)
    probe, drafting = decoding(0), decoding(1)
    tally = StepTally(speculation_enabled=True, grammar_s=2.0)
    scheduled = [ScheduledSequence(prefill, 8), ScheduledSequence(probe, 1, 1),
                 ScheduledSequence(drafting, 1, 3)]
    tally.schedule(scheduled, probes=frozenset({0}))
    drafting.token_ids += [6, 7]
    step = tally.finish(None, grammar_s=2.5)
    assert (step.num_sequences, step.num_prefill_tokens, step.num_draft_slots) == (3, 8, 4)
    assert (step.num_drafting, step.num_probes, step.num_output_tokens) == (2, 1, 2)
    assert not step.plain_decode and step.grammar_s == 0.5 and step.finished >= step.started


def test_without_a_grammar_backend_a_grammar_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequestError) as refused:
        asyncio.run(NoGrammarService().compile("json", "{}"))
    assert refused.value.param == "grammar"
