"""The verify phase of a step: per sequence, the rejection sampler's verdict on its draft
over the step's logits, what it makes final (computed tokens, hidden states, the grammar's
state) and what its draft achieved."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engine.hidden_states import keep_hidden
from specdec.engine.kv_cache import KVCache
from specdec.engine.rejection_sampler import accept_greedy, argmax_ids, needs_only_argmax, verify
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.scheduler import ScheduledSequence, Scheduler
from specdec.engine.sequence import Sequence
from specdec.engine.speculation import Speculation
from specdec.engine.step_forward import StepForward
from specdec.engine.tree_sampler import verify_tree
from verifier_svc.drafting.drafter_pool import Draft
from verifier_svc.grammar.verification import GrammarService, Timer, advance
from verifier_svc.sequence_faults import SequenceFaults


@dataclass(slots=True)
class Verified:
    """A sequence's tokens from this step: its accepted drafts plus one recovered or bonus
    token, not appended yet."""

    seq: Sequence
    token_ids: list[int]
    first_row: int  # the sequence's first row in the step's logits


class Verification:
    """Verifies each sequence of a step; a failure is that sequence's alone."""

    def __init__(self, scheduler: Scheduler, speculation: Speculation, grammars: GrammarService,
                 faults: SequenceFaults, eos_token_ids: frozenset[int], kv_cache: KVCache) -> None:
        self.scheduler = scheduler
        self.kv_cache = kv_cache  # where a tree draft's accepted path is moved into place
        self.speculation = speculation
        self.grammars = grammars
        self.faults = faults
        self.eos_token_ids = eos_token_ids

    def verify(self, forward: StepForward) -> list[Verified]:
        """The tokens of every sequence that sampled this step (a prompt chunk short of
        its end only becomes computed)."""
        scheduled, drafts = forward.drafted.scheduled, forward.drafted.drafts
        # Greedy requests without a penalty need only each row's argmax: one call for the
        # step's rows rather than a conversion, an argmax and a sync per sequence.
        step_argmax = (argmax_ids(forward.logits)
                       if any(item.samples and needs_only_argmax(item.seq.params)
                              for item in scheduled) else None)
        verified: list[Verified] = []
        for index, item in enumerate(scheduled):
            if item.seq.is_finished:  # failed in its masking
                continue
            with self.faults.isolate(item.seq):
                token_ids = self._verify_one(item, index, drafts[index], forward, step_argmax)
                if token_ids is not None:
                    verified.append(Verified(item.seq, token_ids,
                                             forward.batch.logit_offsets[index]))
        return verified

    def _verify_one(self, item: ScheduledSequence, index: int, draft: Draft,
                    forward: StepForward, step_argmax: list[int] | None) -> list[int] | None:
        seq, batch = item.seq, forward.batch
        first_row = batch.attn_metadata.query_start_locs[index]
        if not item.samples:
            keep_hidden(seq, forward.hidden, first_row, item.num_query_tokens)
            seq.num_computed_tokens += item.num_query_tokens
            self.scheduler.cache_computed_blocks(seq)
            return None
        first_logit, end_logit = batch.logit_offsets[index], batch.logit_offsets[index + 1]
        only_argmax = step_argmax is not None and needs_only_argmax(seq.params)
        accepted_path = None
        if draft.parents is not None:
            verdict = verify_tree(forward.logits[first_logit:end_logit], draft.token_ids,
                                  draft.parents, seq.token_ids, seq.params,
                                  None if seq.generator is None
                                  else seq.generator.starting_at(seq.num_output_tokens),
                                  target_argmax_ids=(step_argmax[first_logit:end_logit]
                                                     if step_argmax is not None and only_argmax
                                                     else None),
                                  prompt_len=seq.prompt_len, eos_token_ids=self.eos_token_ids)
            new_token_ids, accepted_path = verdict.token_ids, verdict.path
            self._keep_path(forward, first_row + item.num_query_tokens, first_logit + 1,
                            accepted_path)
        elif step_argmax is not None and only_argmax:
            new_token_ids = accept_greedy(step_argmax[first_logit:end_logit], draft.token_ids)
        else:
            new_token_ids = verify(forward.logits[first_logit:end_logit], draft.token_ids,
                                   seq.token_ids, seq.params,
                                   None if seq.generator is None
                                   else seq.generator.starting_at(seq.num_output_tokens),
                                   draft.probs, prompt_len=seq.prompt_len,
                                   eos_token_ids=self.eos_token_ids)
        num_accepted = len(new_token_ids) - 1
        keep_hidden(seq, forward.hidden, first_row, item.num_query_tokens + num_accepted)
        seq.num_computed_tokens += item.num_query_tokens + num_accepted
        if seq.grammar is not None:
            with Timer(self.grammars):
                advance(seq.grammar, new_token_ids, seq.request_id, self._end_ids(seq.params))
        self.speculation.record(item, draft, num_accepted, accepted_path)
        return new_token_ids

    def _keep_path(self, forward: StepForward, first_node_row: int, first_node_logit: int,
                   path: list[int]) -> None:
        """Moves a tree draft's accepted nodes into the places a flat draft's would hold, the
        k-th accepted node's (k from 0) from its own: its K/V to the slot of the position
        after the root's k-th successor (the slots of the rejected nodes are trimmed with
        the sequence's), its logits row and its hidden states row to row k of the nodes, so
        that what reads them after (logprobs, the drafter's hidden states, the next step's
        attention) reads a flat draft's. Node i's rows are first_*_row + i; its index is at
        least its depth - 1, so no source is overwritten before it is read (and each move
        gathers before it writes)."""
        moves = [(node, k) for k, node in enumerate(path) if node != k]
        if not moves:
            return
        sources = [node for node, _ in moves]
        targets = [k for _, k in moves]
        slots = forward.batch.attn_metadata.slot_mapping
        with torch.inference_mode():  # the forward's outputs are inference tensors
            self.kv_cache.move_slots(slots[[first_node_row + i for i in sources]],
                                     slots[[first_node_row + i for i in targets]])
            _move_rows(forward.logits, first_node_logit, sources, targets)
            if forward.hidden is not None:
                _move_rows(forward.hidden, first_node_row, sources, targets)

    def _end_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a sequence with these parameters."""
        stop_ids = frozenset(params.stop_token_ids)
        return stop_ids if params.ignore_eos else stop_ids | self.eos_token_ids


def _move_rows(rows: torch.Tensor, first_row: int, sources: list[int], targets: list[int]) -> None:
    """rows[first_row + targets[i]] = rows[first_row + sources[i]] for every i, in place."""
    rows[[first_row + i for i in targets]] = rows[[first_row + i for i in sources]]
