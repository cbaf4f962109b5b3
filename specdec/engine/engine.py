"""The verifier's engine: one step at a time, each step five phases, each one call:
1. schedule: the speculation plans each running sequence's draft length and the scheduler
   picks the sequences and reserves their KV slots, draft slots included (`Scheduler`);
2. draft: the drafters propose up to that many tokens for each sequence in decode (one
   message per drafter replica, bounded by a deadline: a late proposal just means no
   draft), cut to the sequence's grammar and, under the adaptive policy, to what their
   evidence pays for (`Speculation.draft`);
3. forward: one forward over every chunk and draft, its logits masked to the grammars;
4. verify: the rejection sampler keeps each sequence's accepted drafts plus one recovered
   or bonus token (`Verification`);
5. append: the tokens are appended up to a stop condition and streamed, and the sequence's
   KV shrinks back to what was accepted (`Appender`).
What the step did is measured once, in a `StepRecord`, which the speculation learns from
and `step_listener` receives.

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
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from specdec.config import EngineConfig
from specdec.engine.adaptive_speculation import AdaptiveSpeculation
from specdec.engine.appender import Appender
from specdec.engine.position_random import PositionRandom
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.scheduler import ScheduledSequence, Scheduler
from specdec.engine.sequence import FinishReason, Sequence, SpeculationCounters
from specdec.engine.speculation import FixedSpeculation, Speculation, StepDrafts
from specdec.engine.stats_log import StatsLog
from specdec.engine.step_record import StepRecord, StepTally, VerifyRecord
from specdec.engine.step_forward import Forward, StepForward
from specdec.engine.verification import Verification
from specdec.errors import SpecdecError, UnavailableError
from verifier_svc.drafting.drafter_pool import DrafterPool
from verifier_svc.grammar.backend import CompiledGrammar
from verifier_svc.grammar.verification import GrammarService, NoGrammarService
from verifier_svc.model_runner import ModelRunner
from verifier_svc.requests import EngineError, RequestOutput, check_admission, check_request
from verifier_svc.sequence_faults import SequenceFaults

if TYPE_CHECKING:
    from verifier_svc.metrics import VerifierMetrics

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.02
# Event-loop iterations between steps for request handling. gRPC's completion-queue
# thread works while the forward runs (it releases the GIL), so what it queued is ready
# and a few iterations deliver it; a timed pause (1 ms was ~11% of a 9 ms CPU decode
# step) is not needed.
STEP_YIELD_ITERATIONS = 16


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
        # Structured outputs; without a backend requests with a grammar are refused.
        self.grammars = grammars if grammars is not None else NoGrammarService()
        self.faults = SequenceFaults(self._fail)
        self.speculation = _speculation_for(config, runner, drafter_pool, num_speculative_tokens,
                                            self.grammars, self.faults)
        self.forward = Forward(runner, self.grammars, self.faults, vocab_size)
        self.verification = Verification(scheduler, self.speculation, self.grammars, self.faults,
                                         self.eos_token_ids)
        self._seq_ids = itertools.count()
        self._sequences: dict[int, Sequence] = {}
        self._queues: dict[int, asyncio.Queue[RequestOutput | SpecdecError]] = {}
        self.appender = Appender(config, scheduler, self.eos_token_ids, self.faults, self._queues,
                                 self._finish_sequence)
        self._wakeup = asyncio.Event()
        self._accepting = True
        self._loop_task: asyncio.Task[None] | None = None
        self._stats_log = StatsLog()
        # Set by the server when metrics are exported; observed as requests finish.
        self.metrics: VerifierMetrics | None = None
        # Called after every step that ran (bench concurrency); None: nothing is counted.
        self.step_listener: Callable[[StepRecord], None] | None = None

    @property
    def num_steps(self) -> int:
        """Forwards run."""
        return self.forward.num_steps

    @property
    def spec(self) -> SpeculationCounters:
        """Speculation counters, engine-wide."""
        return self.speculation.counters

    @property
    def drafter_pool(self) -> DrafterPool | None:
        return self.speculation.drafter_pool

    @property
    def speculation_enabled(self) -> bool:
        """False: no sequence drafts, as if every request had asked for no speculation
        (the policy plans nothing and probes nothing); requests keep their own settings
        for when it is True again. `bench concurrency` switches it to compare in one run."""
        return self.speculation.enabled

    @speculation_enabled.setter
    def speculation_enabled(self, enabled: bool) -> None:
        self.speculation.enabled = enabled

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.speculation.start()
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
        await self.speculation.close()
        await self.grammars.close()

    # ------------------------------------------------------------ requests

    async def compile_grammar(self, kind: str, value: str) -> CompiledGrammar:
        """A request's constraint, compiled off the loop (cached by its text); raises
        InvalidRequestError naming `grammar` when it does not compile."""
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
        check_request(prompt_token_ids, params, self.vocab_size, self.config.context_len)
        check_admission(self.config, len(self._sequences))
        max_k = self.speculation.num_speculative_tokens
        num_speculative_tokens = max(0, min(max_k if num_speculative_tokens is None
                                            else num_speculative_tokens, max_k))
        generator = None if params.seed is None else PositionRandom(params.seed)
        seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id,
                       token_ids=list(prompt_token_ids), prompt_len=len(prompt_token_ids),
                       params=params, max_speculative_tokens=num_speculative_tokens,
                       generator=generator, cache_salt=cache_salt)
        # A drafter that needs the target's hidden states needs them for the whole context,
        # which a prefix-cache hit would skip computing.
        seq.may_reuse_prefix = not (num_speculative_tokens and self.speculation.hidden_layer_ids)
        if grammar is not None:
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
        if not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.ABORT)
        self.speculation.forget(seq_id)

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

    async def step(self) -> None:
        """One step: schedule, draft, forward, verify, append (see the module's docstring)."""
        tally = StepTally(speculation_enabled=self.speculation.enabled,
                          grammar_s=self.grammars.seconds)
        forward: StepForward | None = None
        try:
            scheduled = self._schedule(tally)
            if not scheduled:
                return
            drafted = await self._draft(scheduled)
            if drafted.scheduled:  # not every sequence ended while the drafters answered
                forward = self.forward.run(drafted)
                verified = self.verification.verify(forward)
                self.appender.append(verified, forward.logits)
            self._record(tally, forward)
        except Exception:
            self._fail_step(tally.scheduled)

    def _schedule(self, tally: StepTally) -> list[ScheduledSequence]:
        """The step's sequences, each with its draft slots planned; those a failure in
        the plan ended are left out."""
        plan = self.speculation.plan(self.scheduler.running)
        scheduled = self.scheduler.schedule(plan).scheduled
        self.faults.flush()
        scheduled = [item for item in scheduled if not item.seq.is_finished]
        tally.schedule(scheduled, self.speculation.probes)
        return scheduled

    async def _draft(self, scheduled: list[ScheduledSequence]) -> StepDrafts:
        drafted = await self.speculation.draft(scheduled)
        if self.metrics is not None and drafted.round_trip_s is not None:
            self.metrics.observe_round_trip(drafted.round_trip_s)
        return drafted

    def _record(self, tally: StepTally, forward: StepForward | None) -> None:
        """The step's record, to the speculation and the step listener; `forward`: None
        when the step ran none."""
        verify = None
        if forward is not None:
            drafted = forward.drafted
            verify = VerifyRecord(forward.batch.input_ids.numel(),
                                  sum(1 for draft in drafted.drafts if draft.token_ids),
                                  time.perf_counter() - drafted.answered,
                                  all(item.num_query_tokens == 1 for item in drafted.scheduled))
        record = tally.finish(verify, self.grammars.seconds)
        self.scheduler.observe_step(record.finished - record.started)
        self.speculation.observe(record)
        if self.step_listener is not None:
            self.step_listener(record)
        self._stats_log.maybe_log(self.speculation, self.scheduler)

    def _finish_sequence(self, seq: Sequence, finish: FinishReason) -> None:
        if self.metrics is not None:
            self.metrics.observe_finished(seq, time.monotonic())
        self.scheduler.finish(seq, finish)
        self._sequences.pop(seq.seq_id, None)
        self._queues.pop(seq.seq_id, None)
        self.speculation.finished(seq)

    def _fail(self, seq: Sequence, error: SpecdecError) -> None:
        queue = self._queues.get(seq.seq_id)
        try:
            self.abort(seq.seq_id)
        finally:
            # Whatever the abort met, the client hears of the failure: nothing hangs.
            if queue is not None:
                queue.put_nowait(error)

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


def _speculation_for(config: EngineConfig, runner: ModelRunner, drafter_pool: DrafterPool | None,
                     num_speculative_tokens: int, grammars: GrammarService,
                     faults: SequenceFaults) -> Speculation:
    """No speculation without drafters; else the adaptive policy's, when configured, or
    every sequence's cap."""
    if drafter_pool is None:
        return Speculation()
    kind = (AdaptiveSpeculation if config.adaptive_speculation and num_speculative_tokens
            else FixedSpeculation)
    return kind(config, drafter_pool, num_speculative_tokens, grammars, faults,
                runner.model.config.hidden_size, runner.dtype)
