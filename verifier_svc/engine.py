"""The verifier's engine: schedule, draft, verify, stream; one step at a time.

A step is three phases:
1. `scheduler.schedule()` picks the sequences and reserves their KV slots;
2. the drafter pool proposes up to k tokens for each sequence in decode (one message per
   drafter replica, bounded by a deadline: a late proposal just means no draft);
3. one forward over every chunk and draft, then the rejection sampler keeps the accepted
   drafts plus one recovered or bonus token, and the sequence's KV shrinks back to what
   was accepted.

All engine state is touched only on the event loop's thread, and the forward runs there
too, blocking the loop for its duration: measured here, torch's OpenMP kernels run a
decode forward ~1.6x slower from a worker thread than from the main thread, far more
than the loop loses by pausing. Requests that arrive meanwhile are taken at the next
step. A sequence aborted while the drafters answer is dropped from the step before its
inputs are built.

Request lifecycle: at most `max_num_seqs + max_waiting_requests` requests are in flight;
one more is refused with `OverloadedError`. A request ends by finishing, by `abort` (its
client went away or timed out) or by failing: what the step does for one sequence (its
grammar, sampling, stop handling, logprobs) fails that sequence alone
(`verifier_svc/sequence_faults.py`); a shared part of the step that raises fails only the
sequences it ran, with a short `EngineError` (INTERNAL; the gateway answers 500), or every request in
flight when it raised before the scheduler's plan said which sequences it runs. Either
way the loop goes on serving new requests, and no block stays taken. On shutdown
`stop_accepting`, `drain`, then `abort_all` for whatever outlived the grace period.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.config import EngineConfig
from specdec.engine.logprobs import LogprobsJob, TokenLogprobs, step_logprobs
from specdec.engine.rejection_sampler import (
    accept_greedy,
    argmax_ids,
    needs_only_argmax,
    verify,
)
from specdec.engine.position_random import PositionRandom
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.scheduler import ScheduledSequence, Scheduler
from specdec.engine.sequence import FinishReason, Sequence, SpeculationCounters
from specdec.errors import InvalidRequestError, SpecdecError, UnavailableError
from verifier_svc.drafting.drafter_pool import Draft, DrafterPool, DraftRequest
from verifier_svc.grammar.backend import CompiledGrammar
from verifier_svc.grammar.verification import (
    GrammarService,
    Timer,
    advance,
    mask_rows,
)
from verifier_svc.model_runner import ModelRunner, PreparedBatch, StepInput
from verifier_svc.requests import (
    EngineError,
    RequestOutput,
    check_admission,
    check_request,
)
from verifier_svc.sequence_faults import SequenceFaults
from verifier_svc.speculation.candidate import Candidate
from verifier_svc.speculation.policy import SpeculationPolicy

if TYPE_CHECKING:
    from verifier_svc.metrics import VerifierMetrics

__all__ = ["Engine", "EngineError", "RequestOutput", "StepRecord"]

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0


DRAIN_POLL_S = 0.02
# Event-loop iterations between steps for request handling. gRPC's completion-queue
# thread works while the forward runs (it releases the GIL), so what it queued is ready
# and a few iterations deliver it; a timed pause (1 ms was ~11% of a 9 ms CPU decode
# step) is not needed.
STEP_YIELD_ITERATIONS = 16
# Loop iterations given to gRPC to write a prompt's sync message before a forward blocks
# the loop.
SYNC_YIELD_ITERATIONS = 4


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step, as `Engine.step_listener` sees it (times from `time.perf_counter`)."""

    started: float
    finished: float
    speculation_enabled: bool
    num_sequences: int       # scheduled this step
    num_prefill_tokens: int  # tokens of prompt chunks: of more than one token, or not sampling
    num_draft_slots: int     # draft tokens planned (the drafter may have proposed fewer)
    num_output_tokens: int   # tokens the step appended to its sequences
    num_probes: int = 0      # of the draft slots, the policy's probes (one token each)
    grammar_s: float = 0.0   # of the step's time, spent on grammars (masks, cuts, forced tokens)


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner, scheduler: Scheduler, *,
                 vocab_size: int, eos_token_ids: tuple[int, ...],
                 num_speculative_tokens: int = 0, drafter_pool: DrafterPool | None = None,
                 grammars: GrammarService | None = None) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_speculative_tokens = num_speculative_tokens if drafter_pool else 0
        self.drafter_pool = drafter_pool
        # Structured outputs; None: requests with a grammar are refused.
        self.grammars = grammars
        # None: every sequence drafts its cap (the request's k, the room left) every step.
        self.policy = (SpeculationPolicy(self.num_speculative_tokens)
                       if config.adaptive_speculation and self.num_speculative_tokens else None)
        self.spec = SpeculationCounters()
        self._logged_off_kinds: set[str] = set()  # see _note_policy_reasons
        self.num_steps = 0
        self._seq_ids = itertools.count()
        self._sequences: dict[int, Sequence] = {}
        self._queues: dict[int, asyncio.Queue[RequestOutput | SpecdecError]] = {}
        self._finished_for_drafter: list[int] = []
        self.faults = SequenceFaults(self._fail)
        self._wakeup = asyncio.Event()
        self._accepting = True
        self._num_aborted = 0
        self._loop_task: asyncio.Task[None] | None = None
        self._last_stats_log = time.monotonic()
        # Set by the server when metrics are exported; observed as requests finish.
        self.metrics: VerifierMetrics | None = None
        # False: no sequence drafts, as if every request had asked for no speculation (the
        # policy plans nothing and probes nothing); requests keep their own settings for
        # when it is True again. `bench concurrency` switches it to compare in one run.
        self.speculation_enabled = True
        # Called after every step that ran (bench concurrency); None: nothing is counted.
        self.step_listener: Callable[[StepRecord], None] | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.drafter_pool is not None:
            await self.drafter_pool.start()
        if self.grammars is not None:
            self.grammars.start_warm_up()
        self._loop_task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        for seq in list(self._sequences.values()):
            self.abort(seq.seq_id)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        if self.drafter_pool is not None:
            await self.drafter_pool.close()
        if self.grammars is not None:
            await self.grammars.close()

    # ------------------------------------------------------------ requests

    async def compile_grammar(self, kind: str, value: str) -> CompiledGrammar:
        """A request's constraint, compiled off the loop (cached by its text); raises
        InvalidRequestError naming `grammar` when it does not compile."""
        if self.grammars is None:
            raise InvalidRequestError("this verifier has no grammar backend", param="grammar")
        return await self.grammars.compile(kind, value)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    num_speculative_tokens: int | None = None,
                    grammar: CompiledGrammar | None = None, cache_salt: str = "",
                    ) -> tuple[int, asyncio.Queue[RequestOutput | SpecdecError]]:
        """Queues a request; returns its sequence id and the queue its outputs arrive on.

        The queue carries `RequestOutput`s, the last with a finish reason, or one
        `SpecdecError` that ends the request (the step failed, the server shut down).
        """
        if not self._accepting:
            raise UnavailableError("the verifier is shutting down; retry on another replica")
        check_request(prompt_token_ids, params, self.vocab_size, self.config.max_model_len)
        check_admission(self.config, len(self._sequences))
        if num_speculative_tokens is None:
            num_speculative_tokens = self.num_speculative_tokens
        num_speculative_tokens = max(0, min(num_speculative_tokens, self.num_speculative_tokens))
        generator = None if params.seed is None else PositionRandom(params.seed)
        seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id,
                       token_ids=list(prompt_token_ids), prompt_len=len(prompt_token_ids),
                       params=params, max_speculative_tokens=num_speculative_tokens,
                       generator=generator, cache_salt=cache_salt)
        # A drafter that needs the target's hidden states needs them for the whole context,
        # which a prefix-cache hit would skip computing.
        seq.may_reuse_prefix = not (num_speculative_tokens and self.hidden_layer_ids)
        if grammar is not None:
            assert self.grammars is not None
            seq.grammar = self.grammars.new_state(grammar)
        queue: asyncio.Queue[RequestOutput | SpecdecError] = asyncio.Queue()
        self._sequences[seq.seq_id] = seq
        self._queues[seq.seq_id] = queue
        self.scheduler.add(seq)
        self._wakeup.set()
        return seq.seq_id, queue

    def abort(self, seq_id: int) -> None:
        """Ends a sequence now (client gone); its KV blocks return to the pool at once."""
        seq = self._sequences.pop(seq_id, None)
        self._queues.pop(seq_id, None)
        if seq is None:
            return
        self._num_aborted += 1
        if not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.ABORT)
        self._forget_in_drafter(seq_id)

    def stop_accepting(self) -> None:
        """From now on `add_request` raises `UnavailableError`; in-flight requests go on."""
        self._accepting = False

    async def drain(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for every request to end; True when none is left."""
        deadline = time.monotonic() + timeout_s
        while self._sequences and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return not self._sequences

    def abort_all(self, error: SpecdecError) -> int:
        """Ends every request with `error` and frees its blocks; returns how many."""
        sequences = list(self._sequences.values())
        for seq in sequences:
            self._fail(seq, error)
        return len(sequences)

    def _forget_in_drafter(self, seq_id: int) -> None:
        if self.drafter_pool is not None:
            self._finished_for_drafter.append(seq_id)
        if self.policy is not None:
            self.policy.forget(seq_id)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_requests(self) -> int:
        """Requests in flight: running, waiting or preempted."""
        return len(self._sequences)

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while True:
            if not self.scheduler.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                # `step` fails its own requests; this is for a failure of that handling.
                logger.exception("engine step failed")
            # The forward blocked the loop: let gRPC admit new calls and deliver
            # cancellations, which take several loop iterations each (one sleep(0) would
            # let a busy engine starve them).
            for _ in range(STEP_YIELD_ITERATIONS):
                await asyncio.sleep(0)

    def _speculative_tokens_for(self, seq: Sequence, batch_cap: int | None = None) -> int:
        """The most draft tokens `seq` may verify this step; `batch_cap`: the step's
        num_speculative_tokens_per_batch_size row."""
        if seq.max_speculative_tokens == 0 or self.drafter_pool is None or not self.speculation_enabled:
            return 0
        if self.drafter_pool.num_healthy() == 0:
            return 0
        if self.hidden_layer_ids and seq.hidden_states is None:
            return 0
        # Drafting past max_tokens or max_model_len would be thrown away.
        room = min(seq.params.max_tokens - seq.num_output_tokens - 1,
                   self.config.max_model_len - seq.num_tokens)
        if batch_cap is not None:
            room = min(room, batch_cap)
        return max(0, min(seq.max_speculative_tokens, room))

    @property
    def hidden_layer_ids(self) -> tuple[int, ...]:
        """The target layers the drafters need states of; () when none (or not known yet)."""
        if self.drafter_pool is None:
            return ()
        return self.drafter_pool.hidden_state_layer_ids or ()

    def _plan_speculation(self) -> Callable[[Sequence], int]:
        """The draft length of each running sequence this step (adaptive, or its cap)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) > limit:
            # vLLM's disable_by_batch_size: so large a batch drafts nothing, not even the
            # policy's probes, and the drafter is not asked.
            return _no_draft
        caps = self.config.draft_caps
        batch_cap = (caps.cap(len(self.scheduler.running), self.num_speculative_tokens)
                     if caps is not None else None)
        if self.policy is None:
            return self._with_forced_drafts(lambda seq: self._speculative_tokens_for(seq, batch_cap))
        candidates: list[Candidate] = []
        num_other_tokens = 0
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens == 1:
                candidates.append(Candidate(seq.seq_id, self._speculative_tokens_for(seq, batch_cap),
                                            synced=seq.num_drafter_calls > 0))
            else:
                num_other_tokens += seq.num_uncomputed_tokens
        num_other_tokens = min(num_other_tokens, self.config.max_num_batched_tokens)
        planned = self.policy.plan(candidates, num_other_tokens)
        self._note_policy_reasons(candidates)
        if self.config.text_drafter:
            # Asked at all, a text drafter is asked for the cap: a long match costs it no
            # more, and the arrived draft's evidence decides what is verified.
            caps = {candidate.seq_id: candidate.max_tokens for candidate in candidates}
            return self._with_forced_drafts(
                lambda seq: caps[seq.seq_id] if planned.get(seq.seq_id, 0) > 0 else 0)
        return self._with_forced_drafts(lambda seq: planned.get(seq.seq_id, 0))

    def _note_policy_reasons(self, candidates: list[Candidate]) -> None:
        """Each sequence that could draft carries why the policy planned it none (its
        usage says so; its last steps, with no room left to draft, keep it); the first
        time the policy turns drafting off for a kind of reason, the log says why, once,
        so that "off by choice" is not mistaken for "broken"."""
        assert self.policy is not None
        reasons = self.policy.off_reasons
        could_draft = {candidate.seq_id for candidate in candidates if candidate.max_tokens > 0}
        states = self.policy.states
        for seq in self.scheduler.running:
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

    def _with_forced_drafts(self, plan: Callable[[Sequence], int]) -> Callable[[Sequence], int]:
        """`plan`, and for a sequence with a grammar the tokens it forces as its draft (as
        long as the sequence may draft): they need no drafter and are always accepted."""
        grammars = self.grammars

        def with_forced(seq: Sequence) -> int:
            num_tokens = plan(seq)
            if seq.grammar is None or grammars is None:
                return num_tokens
            seq.forced_draft = []
            # Inside the scheduler's plan: a failure is the sequence's, failed after it.
            with Timer(grammars), self.faults.isolate(seq, defer=True):
                seq.forced_draft = seq.grammar.forced_tokens(self._speculative_tokens_for(seq))
            return max(num_tokens, len(seq.forced_draft))

        return with_forced

    async def step(self) -> None:
        started = time.perf_counter()
        grammar_before = self._grammar_seconds()
        speculation_enabled = self.speculation_enabled
        # None until the scheduler has planned: a failure before then cannot say which
        # sequences it concerns.
        scheduled: list[ScheduledSequence] | None = None
        try:
            scheduled = self.scheduler.schedule(self._plan_speculation()).scheduled
            self.faults.flush()
            scheduled = [item for item in scheduled if not item.seq.is_finished]
            if not scheduled:
                return
            listener = self.step_listener
            policy = self.policy
            probes = set(policy.last_probes) if policy is not None else set()
            # A decode step without grammar-forced drafts tells the policy what drafting (or
            # not drafting) realized at this batch size; one whose only drafts are probes
            # (exploration) is neither kind.
            checks_policy = False
            if policy is not None and all(item.num_query_tokens == 1 and item.samples
                                          and not (item.num_speculative_tokens and item.seq.forced_draft)
                                          for item in scheduled):
                drafting = [item.seq.seq_id for item in scheduled if item.num_speculative_tokens]
                checks_policy = not drafting or not probes.issuperset(drafting)
            if listener is not None or checks_policy:
                outputs_before = sum(item.seq.num_output_tokens for item in scheduled)
            if listener is not None:
                num_prefill_tokens = sum(item.num_query_tokens for item in scheduled
                                         if item.num_query_tokens > 1 or not item.samples)
                num_probes = sum(1 for item in scheduled
                                 if item.num_speculative_tokens and item.seq.seq_id in probes)
            await self._run_step(scheduled)
            if listener is not None or checks_policy:
                num_output_tokens = sum(item.seq.num_output_tokens for item in scheduled) - outputs_before
            if checks_policy:
                assert policy is not None
                policy.observe_step(len(scheduled), bool(drafting), num_output_tokens,
                                    time.perf_counter() - started)
            if listener is not None:
                listener(StepRecord(
                    started, time.perf_counter(), speculation_enabled, len(scheduled),
                    num_prefill_tokens, sum(item.num_speculative_tokens for item in scheduled),
                    num_output_tokens, num_probes, self._grammar_seconds() - grammar_before))
        except Exception:
            self._fail_step(scheduled)

    def _end_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a sequence with these parameters."""
        stop_ids = frozenset(params.stop_token_ids)
        return stop_ids if params.ignore_eos else stop_ids | self.eos_token_ids

    def _grammar_seconds(self) -> float:
        return self.grammars.seconds if self.grammars is not None else 0.0

    def _fail_step(self, scheduled: list[ScheduledSequence] | None) -> None:
        """Fails what the failed step concerned, so that no request waits on a loop that
        would only fail again: the step's sequences, or, when the failure came before the
        scheduler's plan (in the plan, the policy), every request in flight, whose state
        (blocks taken, queues left half-moved) is then unknown. Called in an `except`."""
        if scheduled is None:
            sequences = list(self._sequences.values())
            logger.exception("engine step failed before its plan; failing all %d requests",
                             len(sequences))
        else:
            sequences = [item.seq for item in scheduled]
            logger.exception("engine step failed; failing its %d sequences", len(sequences))
        # The client gets a short message, the log the traceback.
        error = EngineError("the engine step serving this request failed; the request was "
                            "aborted")
        for seq in sequences:
            if seq.seq_id in self._sequences:  # not finished or aborted during the step
                try:
                    self._fail(seq, error)
                except Exception:  # the client has its error; fail the others all the same
                    logger.exception("failing request %s raised", seq.request_id)
        # Whatever the scheduler still holds for no request (a failure between its own
        # bookkeeping steps) is freed: it would keep blocks and keep the loop stepping.
        scheduler = self.scheduler
        for seq in [*scheduler.running, *scheduler.waiting]:
            if seq.seq_id not in self._sequences:
                scheduler.block_manager.free(seq)
                (scheduler.running if seq in scheduler.running else scheduler.waiting).remove(seq)

    async def _run_step(self, scheduled: list[ScheduledSequence]) -> None:
        hidden_layer_ids = self.hidden_layer_ids
        if hidden_layer_ids:
            self._start_capture(scheduled)
        num_aborted = self._num_aborted
        drafts, round_trip_s = await self._propose(scheduled)
        await self._sync_new_prompts(scheduled)
        verify_started = time.perf_counter()
        if self._num_aborted != num_aborted:
            # Sequences aborted while the drafters answered hold no blocks any more.
            scheduled = [item for item in scheduled if not item.seq.is_finished]
            if not scheduled:
                return
        scheduled, step_drafts = self._step_drafts(scheduled, drafts, round_trip_s)
        if not scheduled:
            return
        batch = self.runner.prepare(self._build_inputs(scheduled, step_drafts))
        logits, hidden = self.runner.execute(batch, hidden_layer_ids)
        self.num_steps += 1
        self._mask_grammar_rows(scheduled, step_drafts, batch, logits)
        # Greedy requests without a penalty need only each row's argmax: one call for the
        # step's rows rather than a conversion, an argmax and a sync per sequence.
        step_argmax = (argmax_ids(logits) if any(item.samples and needs_only_argmax(item.seq.params)
                                                 for item in scheduled) else None)
        logprobs_jobs: list[tuple[Sequence, LogprobsJob]] = []
        for index, item in enumerate(scheduled):
            seq = item.seq
            if seq.is_finished:  # aborted while the forward ran, or failed in its masking
                continue
            with self.faults.isolate(seq):
                job = self._verify_one(item, index, step_drafts[index], batch, logits, hidden,
                                       step_argmax)
                if job is not None:
                    logprobs_jobs.append((seq, job))
        if logprobs_jobs:
            self._append_with_logprobs(logits, logprobs_jobs)
        if self.policy is not None and all(item.num_query_tokens == 1 for item in scheduled):
            # What a verified token costs: inputs, forward, logits and the sampler, for
            # decode steps only (a prefill chunk's attention would skew the per-token cost).
            self.policy.observe_verify(batch.input_ids.numel(),
                                       sum(1 for draft in step_drafts if draft.token_ids),
                                       time.perf_counter() - verify_started)
        self._maybe_log_stats()

    def _verify_one(self, item: ScheduledSequence, index: int, draft: Draft,
                    batch: PreparedBatch, logits: torch.Tensor, hidden: torch.Tensor | None,
                    step_argmax: torch.Tensor | None) -> LogprobsJob | None:
        """Verifies one sequence's rows and appends its tokens; returns its logprobs job
        instead of appending when the request asked for logprobs."""
        seq = item.seq
        if not item.samples:
            self._keep_hidden(seq, hidden, batch, index, item.num_query_tokens)
            seq.num_computed_tokens += item.num_query_tokens
            self.scheduler.cache_computed_blocks(seq)
            return None
        first_row, end_row = batch.logit_offsets[index], batch.logit_offsets[index + 1]
        if step_argmax is not None and needs_only_argmax(seq.params):
            new_token_ids = accept_greedy(step_argmax[first_row:end_row], draft.token_ids)
        else:
            new_token_ids = verify(logits[first_row:end_row], draft.token_ids, seq.token_ids, seq.params,
                                   None if seq.generator is None
                                   else seq.generator.starting_at(seq.num_output_tokens),
                                   draft.probs, prompt_len=seq.prompt_len,
                                   eos_token_ids=self.eos_token_ids)
        num_accepted = len(new_token_ids) - 1
        self._keep_hidden(seq, hidden, batch, index, item.num_query_tokens + num_accepted)
        seq.num_computed_tokens += item.num_query_tokens + num_accepted
        if seq.grammar is not None and self.grammars is not None:
            with Timer(self.grammars):
                advance(seq.grammar, new_token_ids, seq.request_id, self._end_ids(seq.params))
        if draft.forced:
            # The grammar's draft, not the drafter's: counted apart, and the drafter
            # hears of no acceptance of its own.
            seq.num_last_accepted = 0
            seq.spec.num_forced_tokens += num_accepted
            self.spec.num_forced_tokens += num_accepted
        else:
            seq.num_last_accepted = num_accepted
            seq.spec.record(len(draft.token_ids), num_accepted)
            self.spec.record(len(draft.token_ids), num_accepted)
            if self.policy is not None:
                self.policy.record_draft(seq.seq_id, len(draft.token_ids), num_accepted,
                                         item.num_speculative_tokens)
                if draft.confidence:
                    self.policy.record_confidence(draft.confidence, num_accepted)
        if seq.params.logprobs is not None:
            # Appended by the caller, with the step's logprobs computed in one pass (until
            # then seq.token_ids is still the context before first_row: no copy needed).
            return LogprobsJob(first_row, new_token_ids, seq.token_ids, seq.params,
                               seq.prompt_len)
        self._append_tokens(seq, new_token_ids)
        return None

    def _append_with_logprobs(self, logits: torch.Tensor,
                              jobs: list[tuple[Sequence, LogprobsJob]]) -> None:
        """Appends each job's tokens with their logprobs, computed in one pass; when that
        pass raises, one job at a time, so that only the failing sequence fails."""
        try:
            entries = step_logprobs(logits, [job for _, job in jobs], self.config.logprobs_mode,
                                    self.eos_token_ids)
        except Exception:
            entries = None
        for position, (seq, job) in enumerate(jobs):
            with self.faults.isolate(seq):
                seq_entries = (entries[position] if entries is not None else
                               step_logprobs(logits, [job], self.config.logprobs_mode,
                                             self.eos_token_ids)[0])
                self._append_tokens(seq, job.emitted_ids, seq_entries)

    def _mask_grammar_rows(self, scheduled: list[ScheduledSequence], step_drafts: list[Draft],
                           batch: PreparedBatch, logits: torch.Tensor) -> None:
        """Sets, in place, the logits the sequences' grammars forbid to -inf, at every row
        that verifies a token (before acceptance and the greedy argmax)."""
        if self.grammars is None:
            return
        constrained = [(index, item.seq) for index, item in enumerate(scheduled)
                       if item.samples and item.seq.grammar is not None and not item.seq.is_finished]
        if not constrained:
            return
        jobs = [(batch.logit_offsets[index], seq.grammar, step_drafts[index].token_ids)
                for index, seq in constrained]
        with Timer(self.grammars):
            failures = mask_rows(logits, jobs, self.vocab_size)  # type: ignore[arg-type]
        for job_index, exc in failures:
            self.faults.fail(constrained[job_index][1], exc)

    def _start_capture(self, scheduled: list[ScheduledSequence]) -> None:
        """Gives hidden-state buffers to sequences whose first forward is this step.

        A sequence that ran before any drafter asked for states never gets a buffer,
        and so is never drafted for: its drafter would lack the states of its prefix.
        """
        width = len(self.hidden_layer_ids) * self.runner.model.config.hidden_size
        for item in scheduled:
            seq = item.seq
            if seq.hidden_states is None and seq.num_computed_tokens == 0:
                capacity = seq.prompt_len + seq.params.max_tokens
                seq.hidden_states = torch.empty(capacity, width, dtype=self.runner.dtype)

    def _keep_hidden(self, seq: Sequence, hidden: torch.Tensor | None, batch: PreparedBatch,
                     index: int, num_valid: int) -> None:
        """Stores the states of the tokens this step computed for good (rejected drafts' rows
        are left out)."""
        if hidden is None or seq.hidden_states is None:
            return
        first_row = batch.attn_metadata.query_start_locs[index]
        start = seq.num_computed_tokens
        seq.hidden_states[start:start + num_valid] = hidden[first_row:first_row + num_valid]

    async def _propose(self, scheduled: list[ScheduledSequence]) -> tuple[dict[int, Draft], float]:
        """The drafts by sequence id and the round trip's seconds (0.0 when none was asked)."""
        if self.drafter_pool is None:
            return {}, 0.0
        asked = [item for item in scheduled
                 if item.num_speculative_tokens > 0 and not item.seq.forced_draft]
        if not asked:
            return {}, 0.0
        requests = [
            DraftRequest(item.seq.seq_id, item.seq.token_ids, item.seq.num_last_accepted,
                         item.num_speculative_tokens,
                         None if item.seq.hidden_states is None
                         else item.seq.hidden_states[:item.seq.num_computed_tokens])
            for item in asked]
        finished, self._finished_for_drafter = self._finished_for_drafter, []
        # A sequence's first ask sends its whole context (and an EAGLE or draft-model drafter
        # prefills it): a one-time cost, kept out of the per-step drafting cost the policy
        # plans with and timed apart (the policy charges it to a new sequence's first draft).
        num_first_asks = sum(1 for item in asked if item.seq.num_drafter_calls == 0)
        for item in asked:
            item.seq.num_drafter_calls += 1
        started = time.perf_counter()
        drafts = await self.drafter_pool.propose(requests, finished, self.config.draft_timeout_s)
        seconds = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.observe_round_trip(seconds)
        if self.policy is not None:
            longest = max(request.num_speculative_tokens for request in requests)
            if num_first_asks:  # priced apart: for EAGLE a first ask is dear
                self.policy.observe_first_asks(num_first_asks, longest, seconds)
            else:
                self.policy.observe_drafting(longest, seconds)
        return drafts, seconds

    async def _sync_new_prompts(self, scheduled: list[ScheduledSequence]) -> None:
        """Sends the prompt of each sequence scheduled for the first time to the drafter
        (no drafts asked, no answer awaited), after this step's ask so that it delays no
        draft: the drafter takes it in (a suffix trie over 1,000 prompt tokens is ~16 ms of
        Python) while the verifier prefills, rather than in the sequence's first ask, the
        step's round trip that every sequence then waits on. Only for drafters that take a
        context in as it arrives (`EngineConfig.text_drafter`)."""
        pool = self.drafter_pool
        if (pool is None or not self.config.text_drafter or self.hidden_layer_ids
                or not self.speculation_enabled):
            return
        # Its first step, normally (a prefix-cache hit starts past the cached blocks).
        new = [item.seq for item in scheduled
               if item.seq.num_drafter_calls == 0 and item.seq.max_speculative_tokens != 0]
        if not new:
            return
        pool.sync([DraftRequest(seq.seq_id, seq.token_ids, 0, 0) for seq in new])
        for seq in new:
            seq.num_drafter_calls += 1  # its first ask is a steady one
        # The forward blocks the loop: let gRPC write the message first.
        for _ in range(SYNC_YIELD_ITERATIONS):
            await asyncio.sleep(0)

    def _step_drafts(self, scheduled: list[ScheduledSequence], drafts: dict[int, Draft],
                     round_trip_s: float) -> tuple[list[ScheduledSequence], list[Draft]]:
        """Each sequence's draft this step (forced, or the drafter's cut to its grammar and
        the policy's evidence), beside the sequences still in the step: one whose grammar
        failed on its draft is failed and left out."""
        step_drafts: list[Draft] = []
        for item in scheduled:
            seq = item.seq
            draft = _NO_DRAFT
            if item.num_speculative_tokens > 0 and seq.forced_draft:
                draft = Draft(token_ids=seq.forced_draft[:item.num_speculative_tokens], probs=None,
                              forced=True)
            elif item.num_speculative_tokens > 0:
                proposed = drafts.get(seq.seq_id)
                if proposed is not None and proposed.token_ids:
                    draft = _truncate(proposed, item.num_speculative_tokens)
                    if seq.grammar is not None and self.grammars is not None:
                        with Timer(self.grammars), self.faults.isolate(seq):
                            draft = _truncate(draft, seq.grammar.valid_prefix_len(draft.token_ids))
            step_drafts.append(draft)
        if any(item.seq.is_finished for item in scheduled):
            kept = [(item, draft) for item, draft in zip(scheduled, step_drafts)
                    if not item.seq.is_finished]
            scheduled, step_drafts = [item for item, _ in kept], [draft for _, draft in kept]
        if self.policy is not None and self.config.text_drafter:
            self._cut_by_evidence(scheduled, step_drafts, round_trip_s)
        return scheduled, step_drafts

    def _build_inputs(self, scheduled: list[ScheduledSequence],
                      step_drafts: list[Draft]) -> list[StepInput]:
        inputs: list[StepInput] = []
        for item, draft in zip(scheduled, step_drafts):
            seq = item.seq
            start = seq.num_computed_tokens
            chunk = seq.token_ids[start:start + item.num_query_tokens]
            num_logit_rows = 1 + len(draft.token_ids) if item.samples else 0
            inputs.append(StepInput(chunk + draft.token_ids, start, seq.block_table, num_logit_rows))
        return inputs

    def _cut_by_evidence(self, scheduled: list[ScheduledSequence], step_drafts: list[Draft],
                         round_trip_s: float) -> None:
        """Cuts, in place, each drafter draft that came with a confidence to the prefix the
        policy finds pays at this batch's cost, the step's round trip (`round_trip_s`) already
        paid (`SpeculationPolicy.evidence_lengths`)."""
        assert self.policy is not None
        indices = [index for index, draft in enumerate(step_drafts)
                   if draft.token_ids and not draft.forced and draft.confidence]
        if not indices:
            return
        num_plain = sum(1 for item in scheduled if item.samples)
        num_other = sum(item.num_query_tokens for item in scheduled) - num_plain
        lengths = self.policy.evidence_lengths(
            [step_drafts[index].confidence or [] for index in indices], num_plain, num_other,
            round_trip_s)
        for index, length in zip(indices, lengths):
            step_drafts[index] = _truncate(step_drafts[index], length)

    def _append_tokens(self, seq: Sequence, new_token_ids: list[int],
                       logprobs: list[TokenLogprobs] | None = None) -> None:
        """Appends verified tokens, stopping at the first stop condition, and streams them
        (with their logprobs, one per new token, when the request asked)."""
        params = seq.params
        visible: list[int] = []
        finish: FinishReason | None = None
        for token_id in new_token_ids:
            seq.token_ids.append(token_id)
            if (token_id in params.stop_token_ids
                    or (not params.ignore_eos and token_id in self.eos_token_ids)):
                # Counted in usage, not streamed: vLLM drops the stop token from the text.
                seq.num_hidden_output_tokens += 1
                finish = FinishReason.STOP
                break
            visible.append(token_id)
            if (seq.num_output_tokens >= params.max_tokens
                    or seq.num_tokens >= self.config.max_model_len):
                finish = FinishReason.LENGTH
                break
        # Before a finish frees them: the blocks of verified tokens outlive the request.
        self.scheduler.cache_computed_blocks(seq)
        queue = self._queues.get(seq.seq_id)
        output = RequestOutput(visible, finish, seq.prompt_len, seq.num_output_tokens, seq.spec,
                               None if logprobs is None else logprobs[:len(visible)],
                               seq.num_cached_tokens)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if finish is not None:
            if self.metrics is not None:
                self.metrics.observe_finished(seq, time.monotonic())
            self.scheduler.finish(seq, finish)
            self._sequences.pop(seq.seq_id, None)
            self._queues.pop(seq.seq_id, None)
            if self.drafter_pool is not None:
                self.drafter_pool.record_finished_output(
                    seq.seq_id, seq.token_ids[:seq.prompt_len], seq.token_ids[seq.prompt_len:])
            self._forget_in_drafter(seq.seq_id)
        else:
            # Rejected drafts' slots go back to the pool.
            self.scheduler.block_manager.trim(seq, seq.num_tokens)
        if queue is not None:
            queue.put_nowait(output)

    def _fail(self, seq: Sequence, error: SpecdecError) -> None:
        queue = self._queues.get(seq.seq_id)
        try:
            self.abort(seq.seq_id)
        finally:
            # Whatever the abort met, the client hears of the failure: nothing hangs.
            if queue is not None:
                queue.put_nowait(error)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_log < STATS_LOG_INTERVAL_S or self.spec.num_drafts == 0:
            return
        self._last_stats_log = now
        spec = self.spec
        per_position = ", ".join(f"{n / spec.num_drafts:.2f}" for n in spec.accepted_per_position)
        realized = ""
        if self.policy is not None and self.num_running:
            efficiency = self.policy.realized.efficiency(self.num_running)
            if efficiency is not None:
                realized = (f"; at this batch size drafting steps yield {efficiency:.2f}x plain, "
                            f"draft cost x{self.policy.realized.cost_scale(self.num_running):.2f}")
        logger.info(
            "speculation: acceptance rate %.3f, mean acceptance length %.2f, per-position "
            "acceptance [%s], drafts %d; running %d, waiting %d, KV usage %.1f%%%s",
            spec.num_accepted_tokens / max(1, spec.num_draft_tokens),
            1 + spec.num_accepted_tokens / spec.num_drafts, per_position, spec.num_drafts,
            self.num_running, self.num_waiting, 100 * self.scheduler.block_manager.usage, realized)


_NO_DRAFT = Draft(token_ids=[], probs=None)


def _no_draft(seq: Sequence) -> int:
    return 0


def _truncate(draft: Draft, num_tokens: int) -> Draft:
    if len(draft.token_ids) <= num_tokens:
        return draft
    probs = draft.probs[:num_tokens] if draft.probs is not None else None
    confidence = draft.confidence[:num_tokens] if draft.confidence is not None else None
    return Draft(token_ids=draft.token_ids[:num_tokens], probs=probs, confidence=confidence,
                 forced=draft.forced)
