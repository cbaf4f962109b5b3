"""The forward phase of a step: one forward of the target over every sequence's chunk and
draft, its logits masked to the sequences' grammars."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engine.draft_tree import segment_parents
from specdec.engine.speculation import StepDrafts
from verifier_svc.grammar.verification import GrammarService, Timer, mask_rows
from verifier_svc.model_runner import ModelRunner, PreparedBatch, StepInput
from verifier_svc.sequence_faults import SequenceFaults


@dataclass(slots=True)
class StepForward:
    """A step's forward: what it verifies, the batch it ran and its logits (masked to the
    sequences' grammars) and captured hidden states."""

    drafted: StepDrafts
    batch: PreparedBatch
    logits: torch.Tensor
    hidden: torch.Tensor | None


class Forward:
    """Runs each step's forward through `runner`; a grammar that raises masking its rows
    fails its sequence alone."""

    def __init__(self, runner: ModelRunner, grammars: GrammarService, faults: SequenceFaults,
                 vocab_size: int) -> None:
        self.runner = runner
        self.grammars = grammars
        self.faults = faults
        self.vocab_size = vocab_size
        self.num_steps = 0

    def run(self, drafted: StepDrafts) -> StepForward:
        """One forward over every chunk and draft; the logits a sequence's grammar forbids
        are set to -inf, at every row that verifies a token."""
        inputs: list[StepInput] = []
        for item, draft in zip(drafted.scheduled, drafted.drafts):
            seq = item.seq
            start = seq.num_computed_tokens
            chunk = seq.token_ids[start:start + item.num_query_tokens]
            num_logit_rows = 1 + len(draft.token_ids) if item.samples else 0
            tree_parents = (None if draft.parents is None
                            else segment_parents(len(chunk), draft.parents))
            inputs.append(StepInput(chunk + draft.token_ids, start, seq.block_table, num_logit_rows,
                                    tree_parents))
        batch = self.runner.prepare(inputs)
        logits, hidden = self.runner.execute(batch, drafted.hidden_layer_ids)
        self.num_steps += 1
        forward = StepForward(drafted, batch, logits, hidden)
        self._mask_grammar_rows(forward)
        return forward

    def _mask_grammar_rows(self, forward: StepForward) -> None:
        """Masks, in place, the rows of sequences with a grammar (before acceptance and
        the greedy argmax)."""
        drafted = forward.drafted
        constrained = [(index, item.seq) for index, item in enumerate(drafted.scheduled)
                       if item.samples and item.seq.grammar is not None and not item.seq.is_finished]
        if not constrained:
            return
        jobs = [(forward.batch.logit_offsets[index], seq.grammar, drafted.drafts[index].token_ids)
                for index, seq in constrained]
        with Timer(self.grammars):
            failures = mask_rows(forward.logits, jobs, self.vocab_size)
        for job_index, exc in failures:
            self.faults.fail(constrained[job_index][1], exc)
