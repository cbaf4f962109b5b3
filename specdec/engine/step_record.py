"""What one engine step did, measured once: what the speculation policy learns from
(`Speculation.observe`) and what `Engine.step_listener` (bench concurrency) counts."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.engine.scheduler import ScheduledSequence


@dataclass(frozen=True, slots=True)
class VerifyRecord:
    """The step's verify: from the drafters' answers to the last token appended."""

    num_input_tokens: int       # rows of the forward: chunks, decode tokens and drafts
    num_drafted_sequences: int  # sequences with a draft of at least one token
    seconds: float
    decodes_only: bool          # every sequence verified one new token (and its draft)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step that ran (times from `time.perf_counter`)."""

    started: float
    finished: float
    speculation_enabled: bool
    num_sequences: int       # scheduled this step
    num_prefill_tokens: int  # tokens of prompt chunks: of more than one token, or not sampling
    num_draft_slots: int     # draft tokens planned (the drafter may have proposed fewer)
    num_output_tokens: int   # tokens the step appended to its sequences
    num_probes: int = 0      # of the drafting sequences, those drafting the policy's probe
    grammar_s: float = 0.0   # of the step's time, spent on grammars (masks, cuts, forced tokens)
    num_drafting: int = 0    # sequences with draft slots
    # Every sequence decodes one sampled token, none with a grammar-forced draft.
    plain_decode: bool = False
    verify: VerifyRecord | None = None  # None: every sequence ended before the forward


class StepTally:
    """A step's record in the making: started before its plan, told what was scheduled,
    completed by `finish` when the step has run."""

    def __init__(self, *, speculation_enabled: bool, grammar_s: float) -> None:
        self.started = time.perf_counter()
        self.speculation_enabled = speculation_enabled
        self.grammar_s_before = grammar_s
        # None until the scheduler has planned: a failure before then cannot say which
        # sequences it concerns.
        self.scheduled: list[ScheduledSequence] | None = None
        self.num_drafting = self.num_probes = self.num_prefill_tokens = 0
        self.num_outputs_before = 0
        self.plain_decode = False

    def schedule(self, scheduled: list[ScheduledSequence], probes: frozenset[int]) -> None:
        """The step's sequences, as scheduled; `probes`: those the policy probes."""
        self.scheduled = scheduled
        drafting = [item for item in scheduled if item.num_speculative_tokens]
        self.num_drafting = len(drafting)
        self.num_probes = sum(1 for item in drafting if item.seq.seq_id in probes)
        self.plain_decode = all(item.num_query_tokens == 1 and item.samples
                                and not (item.num_speculative_tokens and item.seq.forced_draft)
                                for item in scheduled)
        self.num_prefill_tokens = sum(item.num_query_tokens for item in scheduled
                                      if item.num_query_tokens > 1 or not item.samples)
        self.num_outputs_before = sum(item.seq.num_output_tokens for item in scheduled)

    def finish(self, verify: VerifyRecord | None, grammar_s: float) -> StepRecord:
        """The record of the step, run to its end; `grammar_s`: the grammars' seconds now."""
        scheduled = self.scheduled or []
        return StepRecord(
            self.started, time.perf_counter(), self.speculation_enabled, len(scheduled),
            self.num_prefill_tokens, sum(item.num_speculative_tokens for item in scheduled),
            sum(item.seq.num_output_tokens for item in scheduled) - self.num_outputs_before,
            self.num_probes, grammar_s - self.grammar_s_before, self.num_drafting,
            self.plain_decode, verify)
