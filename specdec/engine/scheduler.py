"""Continuous batching: which sequences run this step, and how many tokens each.

The scheduler owns the waiting queue and the running list; the block manager owns the
blocks. Every step it plans, within `max_num_batched_tokens`, in this order:
- each running sequence in decode (one uncomputed token) runs that token plus up to k
  draft slots;
- waiting sequences are admitted while `max_num_seqs` and the budget allow;
- each sequence still prefilling runs its next chunk (chunked prefill) in what is left.
In a step that decodes, a prefill chunk (a new prompt's included) is at most
`long_prefill_token_threshold` tokens and, once step times are measured, as long as keeps
the step within about `prefill_chunk_decode_steps` decode steps' time (the prefill pacer),
so a decode's time between tokens stays near its pace beside a long prompt.
When the pool runs out, a decode first gives up its draft slots, then the youngest
running sequence is preempted: its blocks are freed and it is recomputed later. Nothing
waits on a block that only a waiting sequence could free, so nothing deadlocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.config import EngineConfig
from specdec.engine.block_manager import BlockManager
from specdec.engine.prefill_pacer import PrefillPacer
from specdec.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    # Uncomputed tokens of the sequence run this step (the chunk), drafts excluded.
    num_query_tokens: int
    # Draft slots reserved after them (decode only); drafts may fill fewer.
    num_speculative_tokens: int = 0

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so this step samples tokens for it."""
        return self.seq.num_computed_tokens + self.num_query_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens + s.num_speculative_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.pacer = PrefillPacer(config.prefill_chunk_decode_steps)
        # What the last plan ran, for `observe_step`: its prefill tokens, and whether it decoded.
        self._last_plan = (0, False)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends `seq` (done, aborted or cancelled) and returns its blocks at once."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass

    def schedule(self, speculative_tokens_for: Callable[[Sequence], int]) -> SchedulerOutput:
        """Plans one step. `speculative_tokens_for(seq)` gives the draft length wanted.

        Decodes go first, then admissions, then the chunks of prompts still prefilling (as
        vLLM's chunked prefill): a long prompt fills only the budget the others leave, so a
        running decode gets a token every step and a short request starts next step,
        however long the prompt being prefilled beside them."""
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decoding = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        prefilling = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        budget = self._schedule_running(decoding, speculative_tokens_for, budget, output)
        max_chunk = budget
        if decoding:
            max_chunk = self.pacer.max_chunk(self.config.long_prefill_token_threshold or budget)
        budget = self._admit_waiting(budget, max_chunk, output)
        self._schedule_running(prefilling, speculative_tokens_for, budget, output, max_chunk)
        num_prefill_tokens = sum(item.num_query_tokens for item in output.scheduled
                                 if item.num_query_tokens > 1 or not item.samples)
        self._last_plan = (num_prefill_tokens, bool(decoding))
        return output

    def observe_step(self, seconds: float) -> None:
        """The wall time of the step the last `schedule` planned (for the prefill pacer)."""
        num_prefill_tokens, decoded = self._last_plan
        self.pacer.observe(seconds, num_prefill_tokens, decoded)

    def _schedule_running(self, seqs: list[Sequence],
                          speculative_tokens_for: Callable[[Sequence], int], budget: int,
                          output: SchedulerOutput, max_chunk: int | None = None) -> int:
        """Schedules running `seqs` in order while the budget lasts, each at most `max_chunk`
        tokens, preempting the youngest running sequence when the pool runs out; returns
        the budget left."""
        block_manager = self.block_manager
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an older one earlier in this step
            num_query = min(seq.num_uncomputed_tokens, budget, max_chunk or budget)
            assert num_query >= 1, "a running sequence always has an uncomputed token"
            num_spec = 0
            if num_query == seq.num_uncomputed_tokens == 1:
                num_spec = max(0, min(speculative_tokens_for(seq), budget - 1))
            scheduled_self = True
            while not block_manager.can_allocate(seq, seq.num_computed_tokens + num_query + num_spec):
                if num_spec > 0:
                    num_spec = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim, output)
                if victim is seq:
                    scheduled_self = False
                    break
            if not scheduled_self:
                break
            block_manager.allocate(seq, seq.num_computed_tokens + num_query + num_spec)
            output.scheduled.append(ScheduledSequence(seq, num_query, num_spec))
            budget -= num_query + num_spec
        return budget

    def _admit_waiting(self, budget: int, max_chunk: int, output: SchedulerOutput) -> int:
        """Admits waiting sequences while `max_num_seqs`, the budget and the pool allow, a
        first chunk of at most `max_chunk` tokens each; returns the budget left."""
        block_manager = self.block_manager
        # Prefix blocks that running sequences are computing now; a waiting sequence about to
        # compute the same blocks is held back until they are cached (one prefill for the
        # n choices of a request, or for concurrent requests with one system prompt).
        pending: set[bytes] | None = None
        held: list[Sequence] = []
        while (self.waiting and budget > 0 and not output.preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            hits: list[int] = []
            if seq.may_reuse_prefix and block_manager.enable_prefix_caching:
                hits = block_manager.lookup(seq)
                if pending is None:
                    pending = {digest for running in self.running
                               for digest in block_manager.pending_hashes(running)}
                if block_manager.next_block_hash(seq, len(hits)) in pending:
                    held.append(self.waiting.popleft())
                    continue
            num_cached = len(hits) * block_manager.block_size
            num_query = min(seq.num_tokens - num_cached, budget, max_chunk)
            needed = block_manager.num_blocks_for(num_cached + num_query) - len(hits)
            if needed > block_manager.num_free_after_taking(hits):
                break
            self.waiting.popleft()
            block_manager.take_prefix(seq, hits)
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = num_cached
            block_manager.allocate(seq, num_cached + num_query)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.scheduled.append(ScheduledSequence(seq, num_query, 0))
            budget -= num_query
            if pending is not None:
                pending.update(block_manager.pending_hashes(seq))
        self.waiting.extendleft(reversed(held))
        return budget

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """After a step advanced `seq.num_computed_tokens`: its newly full, verified blocks
        become reusable by other requests."""
        self.block_manager.cache_full_blocks(seq)

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        """Frees `seq`'s blocks; it goes back to the front of the queue and is recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        output.preempted.append(seq)
        output.scheduled[:] = [s for s in output.scheduled if s.seq is not seq]

