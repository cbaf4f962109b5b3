"""Speculation planned by the adaptive policy (`verifier_svc/speculation/policy.py`): each
step it plans every sequence's draft length from what drafting realised so far, a text
drafter's drafts are cut to what their evidence pays for, and every step that ran is
observed."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch

from specdec.config import EngineConfig
from specdec.engine.draft_tree import chain_confidence, path_confidence
from specdec.engine.scheduler import ScheduledSequence
from specdec.engine.sequence import Sequence
from specdec.engine.speculation import FixedSpeculation, truncate
from specdec.engine.step_record import StepRecord
from verifier_svc.drafting.drafter_pool import Draft, DrafterPool
from verifier_svc.grammar.verification import GrammarService
from verifier_svc.sequence_faults import SequenceFaults
from verifier_svc.speculation.candidate import Candidate
from verifier_svc.speculation.policy import SpeculationPolicy

logger = logging.getLogger(__name__)


class AdaptiveSpeculation(FixedSpeculation):
    """Drafters in a pool, each sequence's draft length planned by the policy."""

    policy: SpeculationPolicy

    def __init__(self, config: EngineConfig, drafter_pool: DrafterPool, num_speculative_tokens: int,
                 grammars: GrammarService, faults: SequenceFaults, hidden_size: int,
                 dtype: torch.dtype) -> None:
        super().__init__(config, drafter_pool, num_speculative_tokens, grammars, faults,
                         hidden_size, dtype)
        self.policy = SpeculationPolicy(num_speculative_tokens)
        self._logged_off_kinds: set[str] = set()  # see _note_policy_reasons

    @property
    def probes(self) -> frozenset[int]:
        return frozenset(self.policy.last_probes)

    def _plan_lengths(self, running: list[Sequence],
                      batch_cap: int | None) -> Callable[[Sequence], int]:
        candidates: list[Candidate] = []
        num_other_tokens = 0
        for seq in running:
            if seq.num_uncomputed_tokens == 1:
                candidates.append(Candidate(seq.seq_id, self.max_tokens(seq, batch_cap),
                                            synced=seq.num_drafter_calls > 0))
            else:
                num_other_tokens += seq.num_uncomputed_tokens
        num_other_tokens = min(num_other_tokens, self.config.max_num_batched_tokens)
        planned = self.policy.plan(candidates, num_other_tokens)
        self._note_policy_reasons(running, candidates)
        if self.config.text_drafter:
            # Asked at all, a text drafter is asked for the cap: a long match costs it no
            # more, and the arrived draft's evidence decides what is verified.
            caps = {candidate.seq_id: candidate.max_tokens for candidate in candidates}
            return lambda seq: caps[seq.seq_id] if planned.get(seq.seq_id, 0) > 0 else 0
        return lambda seq: planned.get(seq.seq_id, 0)

    def _note_policy_reasons(self, running: list[Sequence], candidates: list[Candidate]) -> None:
        """Each sequence that could draft carries why the policy planned it none (its
        usage says so; its last steps, with no room left to draft, keep it); the first
        time the policy turns drafting off for a kind of reason, the log says why, once,
        so that "off by choice" is not mistaken for "broken"."""
        reasons = self.policy.off_reasons
        could_draft = {candidate.seq_id for candidate in candidates if candidate.max_tokens > 0}
        states = self.policy.states
        for seq in running:
            if seq.seq_id in could_draft:
                seq.spec.policy = reasons.get(seq.seq_id, "")
                seq.spec.policy_state = states[seq.seq_id]
        reason = self.policy.step_off_reason
        kind = re.sub(r"\d+(\.\d+)?", "#", reason)
        if reason and kind not in self._logged_off_kinds:
            self._logged_off_kinds.add(kind)
            logger.info("speculation is configured but the adaptive policy is not drafting "
                        "now: %s; each response's usage.speculation.policy says when this "
                        "holds for it (--speculation-policy fixed always drafts)", reason)

    def _observe_round_trip(self, num_first_asks: int, max_draft_tokens: int,
                            seconds: float) -> None:
        # A sequence's first ask is a one-time cost, kept out of the per-step drafting cost
        # the policy plans with: priced apart (for EAGLE a first ask is dear) and charged
        # to a new sequence's first draft.
        if num_first_asks:
            self.policy.observe_first_asks(num_first_asks, max_draft_tokens, seconds)
        else:
            self.policy.observe_drafting(max_draft_tokens, seconds)

    def _cut(self, scheduled: list[ScheduledSequence], drafts: list[Draft],
             round_trip_s: float) -> None:
        """Cuts each text drafter's draft that came with a confidence to the prefix the
        policy finds pays at this batch's cost, the step's round trip (`round_trip_s`)
        already paid (`SpeculationPolicy.evidence_lengths`)."""
        if not self.config.text_drafter:
            return
        indices = [index for index, draft in enumerate(drafts)
                   if draft.token_ids and not draft.forced and draft.confidence]
        if not indices:
            return
        num_plain = sum(1 for item in scheduled if item.samples)
        num_other = sum(item.num_query_tokens for item in scheduled) - num_plain
        lengths = self.policy.evidence_lengths(
            [_flat_confidence(drafts[index]) for index in indices], num_plain, num_other,
            round_trip_s)
        for index, length in zip(indices, lengths):
            drafts[index] = truncate(drafts[index], length)

    def record(self, item: ScheduledSequence, draft: Draft, num_accepted: int,
               accepted_path: list[int] | None = None) -> None:
        super().record(item, draft, num_accepted, accepted_path)
        if draft.forced:
            return
        self.policy.record_draft(item.seq.seq_id, len(draft.token_ids), num_accepted,
                                 item.num_speculative_tokens)
        if draft.confidence and draft.parents is None:
            self.policy.record_confidence(draft.confidence, num_accepted)
        elif draft.confidence and draft.parents is not None and accepted_path is not None:
            self.policy.record_confidence(
                path_confidence(draft.parents, draft.confidence, accepted_path), num_accepted)

    def observe(self, record: StepRecord) -> None:
        verify = record.verify
        if verify is not None and verify.decodes_only:
            # What a verified token costs: inputs, forward, logits and the sampler, for
            # decode steps only (a prefill chunk's attention would skew the per-token cost).
            self.policy.observe_verify(verify.num_input_tokens, verify.num_drafted_sequences,
                                       verify.seconds)
        # A decode step without grammar-forced drafts tells the policy what drafting (or
        # not drafting) realized at this batch size; one whose only drafts are probes
        # (exploration) is neither kind.
        if record.plain_decode and (record.num_drafting == 0
                                    or record.num_probes < record.num_drafting):
            self.policy.observe_step(record.num_sequences, record.num_drafting > 0,
                                     record.num_output_tokens, record.finished - record.started)

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        self.policy.forget(seq_id)

    def realized_summary(self, num_running: int) -> str:
        if not num_running:
            return ""
        efficiency = self.policy.realized.efficiency(num_running)
        if efficiency is None:
            return ""
        return (f"; at this batch size drafting steps yield {efficiency:.2f}x plain, "
                f"draft cost x{self.policy.realized.cost_scale(num_running):.2f}")


def _flat_confidence(draft: Draft) -> list[float]:
    """The draft's confidence as a flat draft's (a tree's by `chain_confidence`)."""
    confidence = draft.confidence or []
    return confidence if draft.parents is None else chain_confidence(draft.parents, confidence)
