"""Speculation: how many tokens each sequence drafts, the drafts, and what they realised.

One collaborator of the engine, chosen once when the engine is built (`make_speculation`):
- `Speculation`: no drafter; nothing is drafted, not even a grammar's forced tokens.
- `FixedSpeculation`: every sequence drafts its cap each step (the request's k, the room
  left, the step's `num_speculative_tokens_per_batch_size` row), the tokens a grammar
  forces included; drafts are cut at their first token the grammar rejects.
- `AdaptiveSpeculation` (`adaptive_speculation.py`): the policy plans each length, and
  cuts text drafters' drafts by their evidence.

Each step the engine asks it to `plan` (inside the scheduler's plan), to `draft` (ask the
drafters, cut), to `record` each sequence's acceptance and to `observe` the step's record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.engine.draft_tree import is_chain, main_branch
from specdec.engine.hidden_states import start_capture
from specdec.engine.scheduler import ScheduledSequence
from specdec.engine.sequence import Sequence, SpeculationCounters
from specdec.engine.step_record import StepRecord
from verifier_svc.drafting.drafter_pool import Draft, DrafterPool, DraftRequest
from verifier_svc.grammar.verification import GrammarService, Timer
from verifier_svc.sequence_faults import SequenceFaults
from verifier_svc.speculation.policy import SpeculationPolicy

# Loop iterations given to gRPC to write a prompt's sync message before a forward blocks
# the loop.
SYNC_YIELD_ITERATIONS = 4

NO_DRAFT = Draft(token_ids=[], probs=None)


@dataclass(slots=True)
class StepDrafts:
    """What a step verifies: its sequences still running, each one's draft (`NO_DRAFT`
    when none), and the target layers the forward captures for the drafters."""

    scheduled: list[ScheduledSequence]
    drafts: list[Draft]
    hidden_layer_ids: tuple[int, ...] = ()
    # perf_counter when the drafters' answers were in (the verify's cost starts here).
    answered: float = 0.0
    # The drafters' round trip; None when none was asked.
    round_trip_s: float | None = None


class Speculation:
    """No speculation: every sequence decodes one token a step."""

    num_speculative_tokens = 0
    drafter_pool: DrafterPool | None = None
    policy: SpeculationPolicy | None = None

    def __init__(self) -> None:
        # Engine-wide counters, summed over requests (the metrics' and the stats log's).
        self.counters = SpeculationCounters()
        # False: no sequence drafts, as if every request had asked for no speculation;
        # requests keep their own settings for when it is True again.
        self.enabled = True

    @property
    def hidden_layer_ids(self) -> tuple[int, ...]:
        """The target layers the drafters need states of; () when none (or not known yet)."""
        return ()

    @property
    def probes(self) -> frozenset[int]:
        """The sequences whose draft this step is only the policy's probe (exploration)."""
        return frozenset()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def plan(self, running: list[Sequence]) -> Callable[[Sequence], int]:
        """The draft length of each running sequence this step, for the scheduler."""
        return no_draft

    async def draft(self, scheduled: list[ScheduledSequence]) -> StepDrafts:
        """Each scheduled sequence's draft, the sequences that ended meanwhile left out."""
        return StepDrafts(scheduled, [NO_DRAFT] * len(scheduled), answered=time.perf_counter())

    def record(self, item: ScheduledSequence, draft: Draft, num_accepted: int,
               accepted_path: list[int] | None = None) -> None:
        """Counts what the sequence's draft achieved: `num_accepted` of its tokens (of a
        tree draft, the nodes of `accepted_path`)."""
        seq = item.seq
        if draft.forced:
            # The grammar's draft, not the drafter's: counted apart, and the drafter
            # hears of no acceptance of its own.
            seq.num_last_accepted = 0
            seq.spec.num_forced_tokens += num_accepted
            self.counters.num_forced_tokens += num_accepted
        else:
            seq.num_last_accepted = num_accepted
            seq.spec.record(len(draft.token_ids), num_accepted)
            self.counters.record(len(draft.token_ids), num_accepted)

    def observe(self, record: StepRecord) -> None:
        """Learns from what a step that ran realised."""

    def finished(self, seq: Sequence) -> None:
        """`seq` finished: its output may teach the drafters, its state goes."""
        self.forget(seq.seq_id)

    def forget(self, seq_id: int) -> None:
        """`seq_id` ended: whatever is held for it goes."""

    def realized_summary(self, num_running: int) -> str:
        """What drafting realizes at this batch size, for the stats log ("" when unknown)."""
        return ""


class FixedSpeculation(Speculation):
    """Drafters in a pool: every sequence drafts its cap each step."""

    def __init__(self, config: EngineConfig, drafter_pool: DrafterPool, num_speculative_tokens: int,
                 grammars: GrammarService, faults: SequenceFaults, hidden_size: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.drafter_pool = self._pool = drafter_pool
        self.num_speculative_tokens = num_speculative_tokens
        self.grammars = grammars
        self.faults = faults
        self._hidden_size = hidden_size
        self._dtype = dtype
        # Ended sequences the drafters have not been told of yet (told with the next ask).
        self._finished_seq_ids: list[int] = []

    @property
    def hidden_layer_ids(self) -> tuple[int, ...]:
        return self._pool.hidden_state_layer_ids or ()

    async def start(self) -> None:
        await self._pool.start()

    async def close(self) -> None:
        await self._pool.close()

    def max_tokens(self, seq: Sequence, batch_cap: int | None = None) -> int:
        """The most draft tokens `seq` may verify this step; `batch_cap`: the step's
        num_speculative_tokens_per_batch_size row."""
        if seq.max_speculative_tokens == 0 or not self.enabled:
            return 0
        if self._pool.num_healthy() == 0:
            return 0
        if self.hidden_layer_ids and seq.hidden_states is None:
            return 0
        # Drafting past max_tokens or max_model_len would be thrown away.
        room = min(seq.params.max_tokens - seq.num_output_tokens - 1,
                   self.config.context_len - seq.num_tokens)
        if batch_cap is not None:
            room = min(room, batch_cap)
        return max(0, min(seq.max_speculative_tokens, room))

    def plan(self, running: list[Sequence]) -> Callable[[Sequence], int]:
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            # vLLM's disable_by_batch_size: so large a batch drafts nothing, not even the
            # policy's probes, and the drafter is not asked.
            return no_draft
        caps = self.config.draft_caps
        batch_cap = (caps.cap(len(running), self.num_speculative_tokens)
                     if caps is not None else None)
        return self._with_forced_drafts(self._plan_lengths(running, batch_cap))

    def _plan_lengths(self, running: list[Sequence],
                      batch_cap: int | None) -> Callable[[Sequence], int]:
        """The drafter's draft length of each sequence (its cap here)."""
        return lambda seq: self.max_tokens(seq, batch_cap)

    def _with_forced_drafts(self, plan: Callable[[Sequence], int]) -> Callable[[Sequence], int]:
        """`plan`, and for a sequence with a grammar the tokens it forces as its draft (as
        long as the sequence may draft): they need no drafter and are always accepted."""

        def with_forced(seq: Sequence) -> int:
            num_tokens = plan(seq)
            if seq.grammar is None:
                return num_tokens
            seq.forced_draft = []
            # Inside the scheduler's plan: a failure is the sequence's, failed after it.
            with Timer(self.grammars), self.faults.isolate(seq, defer=True):
                seq.forced_draft = seq.grammar.forced_tokens(self.max_tokens(seq))
            return max(num_tokens, len(seq.forced_draft))

        return with_forced

    async def draft(self, scheduled: list[ScheduledSequence]) -> StepDrafts:
        hidden_layer_ids = self.hidden_layer_ids
        if hidden_layer_ids:
            start_capture(scheduled, len(hidden_layer_ids) * self._hidden_size, self._dtype)
        proposed, round_trip_s = await self._propose(scheduled)
        await self._sync_new_prompts(scheduled)
        answered = time.perf_counter()
        # Sequences aborted while the drafters answered hold no blocks any more.
        scheduled = [item for item in scheduled if not item.seq.is_finished]
        drafts = [self._draft_of(item, proposed) for item in scheduled]
        if any(item.seq.is_finished for item in scheduled):  # a grammar failed on its draft
            kept = [(item, draft) for item, draft in zip(scheduled, drafts)
                    if not item.seq.is_finished]
            scheduled, drafts = [item for item, _ in kept], [draft for _, draft in kept]
        self._cut(scheduled, drafts, round_trip_s or 0.0)
        return StepDrafts(scheduled, drafts, hidden_layer_ids, answered, round_trip_s)

    def _draft_of(self, item: ScheduledSequence, proposed: dict[int, Draft]) -> Draft:
        """The sequence's draft this step: forced, or the drafter's cut to its grammar."""
        seq = item.seq
        if item.num_speculative_tokens == 0:
            return NO_DRAFT
        if seq.forced_draft:
            return Draft(token_ids=seq.forced_draft[:item.num_speculative_tokens], probs=None,
                         forced=True)
        draft = proposed.get(seq.seq_id)
        if draft is None or not draft.token_ids:
            return NO_DRAFT
        if draft.parents is not None and (seq.grammar is not None or not self.config.tree_drafts):
            # A grammar checks one continuation; trees are verified only when configured.
            draft = main_branch_draft(draft, draft.parents)
        draft = truncate(draft, item.num_speculative_tokens)
        if seq.grammar is not None:
            with Timer(self.grammars), self.faults.isolate(seq):
                draft = truncate(draft, seq.grammar.valid_prefix_len(draft.token_ids))
        return draft

    def _cut(self, scheduled: list[ScheduledSequence], drafts: list[Draft],
             round_trip_s: float) -> None:
        """Cuts the drafts, in place, further than their caps and grammars (here: not)."""

    async def _propose(self, scheduled: list[ScheduledSequence]) -> tuple[dict[int, Draft], float | None]:
        """The drafts by sequence id and the round trip's seconds (None when none was asked)."""
        asked = [item for item in scheduled
                 if item.num_speculative_tokens > 0 and not item.seq.forced_draft]
        if not asked:
            return {}, None
        requests = [
            DraftRequest(item.seq.seq_id, item.seq.token_ids, item.seq.num_last_accepted,
                         item.num_speculative_tokens,
                         None if item.seq.hidden_states is None
                         else item.seq.hidden_states[:item.seq.num_computed_tokens])
            for item in asked]
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        # A sequence's first ask sends its whole context (and an EAGLE or draft-model drafter
        # prefills it): a one-time cost, timed apart (see `_observe_round_trip`).
        num_first_asks = sum(1 for item in asked if item.seq.num_drafter_calls == 0)
        for item in asked:
            item.seq.num_drafter_calls += 1
        started = time.perf_counter()
        drafts = await self._pool.propose(requests, finished, self.config.draft_deadline_s)
        seconds = time.perf_counter() - started
        self._observe_round_trip(num_first_asks, max(r.num_speculative_tokens for r in requests),
                                 seconds)
        return drafts, seconds

    def _observe_round_trip(self, num_first_asks: int, max_draft_tokens: int,
                            seconds: float) -> None:
        """Learns from the drafters' round trip (here: nothing)."""

    async def _sync_new_prompts(self, scheduled: list[ScheduledSequence]) -> None:
        """Sends the prompt of each sequence scheduled for the first time to the drafter
        (no drafts asked, no answer awaited), after this step's ask so that it delays no
        draft: the drafter takes it in (a suffix trie over 1,000 prompt tokens is ~16 ms of
        Python) while the verifier prefills, rather than in the sequence's first ask, the
        step's round trip that every sequence then waits on. Only for drafters that take a
        context in as it arrives (`EngineConfig.text_drafter`)."""
        if not self.config.text_drafter or self.hidden_layer_ids or not self.enabled:
            return
        # Its first step, normally (a prefix-cache hit starts past the cached blocks).
        new = [item.seq for item in scheduled
               if item.seq.num_drafter_calls == 0 and item.seq.max_speculative_tokens != 0]
        if not new:
            return
        self._pool.sync([DraftRequest(seq.seq_id, seq.token_ids, 0, 0) for seq in new])
        for seq in new:
            seq.num_drafter_calls += 1  # its first ask is a steady one
        # The forward blocks the loop: let gRPC write the message first.
        for _ in range(SYNC_YIELD_ITERATIONS):
            await asyncio.sleep(0)

    def finished(self, seq: Sequence) -> None:
        self._pool.record_finished_output(
            seq.seq_id, seq.token_ids[:seq.prompt_len], seq.token_ids[seq.prompt_len:])
        super().finished(seq)

    def forget(self, seq_id: int) -> None:
        self._finished_seq_ids.append(seq_id)


def no_draft(seq: Sequence) -> int:
    return 0


def truncate(draft: Draft, num_tokens: int) -> Draft:
    """`draft`'s first `num_tokens` tokens (itself when it is no longer)."""
    if len(draft.token_ids) <= num_tokens:
        return draft
    probs = draft.probs[:num_tokens] if draft.probs is not None else None
    confidence = draft.confidence[:num_tokens] if draft.confidence is not None else None
    # Parents come first, so a tree's leading nodes are a tree; a chain is a flat draft.
    parents = draft.parents[:num_tokens] if draft.parents is not None else None
    return Draft(token_ids=draft.token_ids[:num_tokens], probs=probs, confidence=confidence,
                 forced=draft.forced,
                 parents=None if parents is None or is_chain(parents) else parents)


def main_branch_draft(draft: Draft, parents: list[int]) -> Draft:
    """A tree draft's main branch as a flat draft (its nodes' confidence, each given its
    parent, is a flat draft's given the tokens before it)."""
    nodes = main_branch(parents)
    confidence = (None if draft.confidence is None
                  else [draft.confidence[node] for node in nodes])
    return Draft(token_ids=[draft.token_ids[node] for node in nodes], probs=None,
                 confidence=confidence, forced=draft.forced)
