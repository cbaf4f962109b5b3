"""Drafter gRPC servicer: converts between proto messages and the `Proposer`, nothing more.

Each Propose stream gets its own Proposer (a verifier that reconnects starts fresh).
Per SequenceUpdate, the sequence's drafter state is checked against `context_len`:

- a full context (context_len == len(new_token_ids)) always (re)starts the sequence, so
  a verifier's resync is idempotent;
- a known sequence whose length + len(new_token_ids) == context_len is appended to;
- anything else disagrees: answer needs_resync, propose nothing, drop the state.

Methods that declared target layers (GetInfo.hidden_state_layer_ids) get each update's
`hidden_states` decoded and checked: [rows, hidden_state_width] where rows cover the
context positions the drafter has no row for yet, all but the last (see the proto). A
missing or malformed tensor is INVALID_ARGUMENT for the stream, like any malformed request.

Bounds (a stream must not hold unbounded memory, whoever opened it):
- a token id at or above the vocabulary size (GetInfo's vocab_size; 2**31 when the method
  knows none) is INVALID_ARGUMENT naming sequences.new_token_ids, so no such id is ever
  held or proposed; more sequences in one message than --max-seqs-per-stream likewise;
- finished_outputs (for methods that learn across requests) likewise: ids in the
  vocabulary, at most MAX_FINISHED_OUTPUTS_PER_MESSAGE of them. One longer than the
  method's max-model-len (prompt tail + output) is skipped, like a too-long context; the
  method's own bound (suffix: suffix_decoding_max_cached_requests) caps how many it keeps.
  A method that does not learn ignores them;
- a context longer than the method's max-model-len is not held and never drafted for: its
  state is dropped and the sequence is remembered without tokens (so the verifier is not
  asked to resend it every step) until it finishes. A drafter configured for shorter
  contexts than its verifier costs speed on those sequences, not the stream;
- a stream holds at most --max-seqs-per-stream sequences: a new one evicts the least
  recently updated; a sequence not updated for --seq-idle-timeout-s is evicted too. An
  evicted sequence's next incremental update is answered needs_resync, as after a restart;
- a stream holds at most --max-tokens-per-stream tokens over all its sequences: a sequence
  whose update would pass it is refused, not buffered: its state is dropped and it is
  remembered without tokens, never drafted for (its incremental updates are skipped, not
  answered needs_resync) until it finishes or a full context fits again;
- at most --max-propose-streams streams are open at once; one more is refused with
  RESOURCE_EXHAUSTED (a verifier serves those sequences without drafts and retries later).

Big messages do not stall the other streams: a message's updates are applied one sequence
at a time, the event loop free before each that brings many tokens (a suffix trie over an
8,000-token prompt is ~60 ms of Python), so other streams' drafts keep their deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import grpc

from drafter_svc.proposer import (
    DEFAULT_NGRAM_MAX_MODEL_LEN,
    LearningProposer,
    Proposal,
    Proposer,
    ProposerInfo,
)
from specdec.config_flags import flag
from specdec.errors import ConfigError, InvalidRequestError, OverloadedError, SpecdecError
from specdec.rpc.grpc_status import abort_with
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

if TYPE_CHECKING:
    import torch

    from drafter_svc.metrics import DrafterMetrics

HIDDEN_STATES_FIELD = "sequences.hidden_states"
TOKEN_IDS_FIELD = "sequences.new_token_ids"
FINISHED_OUTPUTS_FIELD = "finished_outputs"
# Far above what a verifier puts in one message (finished_outputs.MESSAGE_MAX_OUTPUTS, or
# a catch-up's share of its replay log, at most about 2**20 / 8).
MAX_FINISHED_OUTPUTS_PER_MESSAGE = 1 << 18
_HIDDEN_STATE_DTYPES = ("float32", "bfloat16", "float16")
# Above any verifier's --max-num-seqs default (256), so a stream from one never evicts.
DEFAULT_MAX_SEQS_PER_STREAM = 1024
# A running sequence is updated every verifier step; one quiet this long was leaked.
DEFAULT_SEQ_IDLE_TIMEOUT_S = 300.0
# A verifier's default --max-num-seqs (256) at a context of 8,192 tokens each.
DEFAULT_MAX_TOKENS_PER_STREAM = 256 * 8192
# One stream per verifier (and per replica name it dials): far above a real deployment's.
DEFAULT_MAX_PROPOSE_STREAMS = 64
# Updates bringing at least this many tokens give the event loop back before them.
YIELD_BEFORE_TOKENS = 512
# Ids accepted when the method knows no vocabulary (ngram without a target directory):
# what int32 holds, the token arrays' dtype.
UNKNOWN_VOCAB_ID_LIMIT = 1 << 31
# A stream that keeps overflowing logs its evictions at most this often.
_FULL_WARNING_INTERVAL_S = 60.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """What one Propose stream may hold (drafter flags); the model's own limits (vocabulary,
    max-model-len) come from ProposerInfo."""

    max_seqs_per_stream: int = field(default=DEFAULT_MAX_SEQS_PER_STREAM, metadata=flag(
        "sequences one verifier stream may hold; a new one evicts the least recently updated "
        "(at least the verifier's --max-num-seqs)"))
    seq_idle_timeout_s: float = field(default=DEFAULT_SEQ_IDLE_TIMEOUT_S, metadata=flag(
        "evict the state of a sequence not updated for this long"))
    max_tokens_per_stream: int = field(default=DEFAULT_MAX_TOKENS_PER_STREAM, metadata=flag(
        "tokens one verifier stream may hold over all its sequences; a sequence that would "
        "pass it is not drafted for"))
    max_propose_streams: int = field(default=DEFAULT_MAX_PROPOSE_STREAMS, metadata=flag(
        "Propose streams open at once; one more is refused with RESOURCE_EXHAUSTED"))

    def __post_init__(self) -> None:
        for name in ("max_seqs_per_stream", "max_tokens_per_stream", "max_propose_streams"):
            if getattr(self, name) < 1:
                option = "--" + name.replace("_", "-")
                raise ConfigError(f"{option} must be >= 1, got {getattr(self, name)}", param=name)
        if not self.seq_idle_timeout_s > 0:
            raise ConfigError(f"--seq-idle-timeout-s must be > 0, got {self.seq_idle_timeout_s}",
                              param="seq_idle_timeout_s")


def token_id_limit(info: ProposerInfo) -> int:
    return info.vocab_size or UNKNOWN_VOCAB_ID_LIMIT


def max_model_len(info: ProposerInfo) -> int:
    return info.max_model_len or DEFAULT_NGRAM_MAX_MODEL_LEN


class SequenceTable:
    """The sequences one stream holds, least recently updated first (see the module docstring).

    Every held sequence is in the table; `too_long` ones hold no state in the proposer.
    """

    def __init__(self, proposer: Proposer, limits: StreamLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proposer = proposer
        self.limits = limits
        self._clock = clock
        self._last_seen: OrderedDict[int, float] = OrderedDict()
        self.too_long: set[int] = set()
        # Refused for --max-tokens-per-stream: held without tokens, like too_long ones.
        self.over_budget: set[int] = set()
        self.num_evicted = 0
        self._last_full_warning = float("-inf")

    def __len__(self) -> int:
        return len(self._last_seen)

    def num_tokens(self) -> int:
        """Tokens held for this stream's sequences."""
        return sum(self.proposer.context_len(seq_id) or 0 for seq_id in self._last_seen)

    def touch(self, seq_id: int) -> None:
        """seq_id was just updated; a new one first evicts the least recently updated ones."""
        if seq_id in self._last_seen:
            self._last_seen.move_to_end(seq_id)
        else:
            evicted = False
            while len(self._last_seen) >= self.limits.max_seqs_per_stream:
                self._evict(next(iter(self._last_seen)))
                evicted = True
            now = self._clock()
            if evicted and now - self._last_full_warning >= _FULL_WARNING_INTERVAL_S:
                self._last_full_warning = now
                logger.warning("a Propose stream holds %d sequences, the most allowed: the "
                               "least recently updated are evicted (%d so far; "
                               "--max-seqs-per-stream must be at least the verifier's "
                               "--max-num-seqs)", self.limits.max_seqs_per_stream,
                               self.num_evicted)
        self._last_seen[seq_id] = self._clock()

    def mark_too_long(self, seq_id: int) -> None:
        self.proposer.remove_sequence(seq_id)
        self.touch(seq_id)
        self.too_long.add(seq_id)

    def mark_over_budget(self, seq_id: int) -> None:
        self.proposer.remove_sequence(seq_id)
        self.touch(seq_id)
        self.over_budget.add(seq_id)

    def remove(self, seq_id: int) -> None:
        self._last_seen.pop(seq_id, None)
        self.too_long.discard(seq_id)
        self.over_budget.discard(seq_id)
        self.proposer.remove_sequence(seq_id)

    def evict_idle(self) -> int:
        """Evicts the sequences not updated for seq_idle_timeout_s; returns how many."""
        oldest_kept = self._clock() - self.limits.seq_idle_timeout_s
        num_evicted = 0
        while self._last_seen:
            seq_id, seen = next(iter(self._last_seen.items()))
            if seen > oldest_kept:
                break
            self._evict(seq_id)
            num_evicted += 1
        if num_evicted:
            logger.info("evicted %d sequences not updated for %.0f s", num_evicted,
                        self.limits.seq_idle_timeout_s)
        return num_evicted

    def _evict(self, seq_id: int) -> None:
        self.remove(seq_id)
        self.num_evicted += 1


class DrafterServicer(specdec_pb2_grpc.DrafterServicer):
    def __init__(self, proposer_factory: Callable[[], Proposer], info: ProposerInfo,
                 metrics: DrafterMetrics | None = None, limits: StreamLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._proposer_factory = proposer_factory
        self._info = info
        self._metrics = metrics
        self.limits = limits or StreamLimits()
        self._clock = clock
        self.tables: set[SequenceTable] = set()  # one per open stream

    def held(self) -> tuple[int, int]:
        """(sequences, tokens) held by all open streams."""
        return (sum(len(table) for table in self.tables),
                sum(table.num_tokens() for table in self.tables))

    async def GetInfo(self, request: specdec_pb2.GetDrafterInfoRequest,
                      context: grpc.aio.ServicerContext) -> specdec_pb2.DrafterInfo:
        info = self._info
        return specdec_pb2.DrafterInfo(
            method=info.method,
            max_num_speculative_tokens=info.max_num_speculative_tokens,
            hidden_state_layer_ids=list(info.hidden_state_layer_ids),
            vocab_size=info.vocab_size,
            tokenizer_fingerprint=info.tokenizer_fingerprint,
            wants_finished_outputs=info.wants_finished_outputs,
        )

    async def Propose(self, request_iterator: AsyncIterator[specdec_pb2.ProposeRequest],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[specdec_pb2.ProposeResponse]:
        if len(self.tables) >= self.limits.max_propose_streams:
            exc = OverloadedError(f"this drafter serves {self.limits.max_propose_streams} "
                                  "Propose streams, the most allowed (--max-propose-streams)")
            logger.warning("Propose stream from %s refused: %s", context.peer(), exc.message)
            await abort_with(context, exc)
            return
        proposer = self._proposer_factory()
        table = SequenceTable(proposer, self.limits, self._clock)
        self.tables.add(table)
        # A stream that goes quiet is swept too: its sequences cannot wait for its next message.
        sweeper = asyncio.create_task(_sweep_idle(table))
        peer = context.peer()
        logger.info("Propose stream opened by %s", peer)
        metrics = self._metrics
        if metrics is not None:
            metrics.open_streams.inc()
        try:
            async for request in request_iterator:
                started = time.perf_counter()
                try:
                    response = await handle_propose_request_sliced(proposer, request, table)
                except SpecdecError as exc:
                    logger.warning("Propose stream from %s: %s", peer, exc.message)
                    await abort_with(context, exc)
                    return
                except Exception:
                    # A bug, not the client's fault: log it here, never send the traceback.
                    logger.exception("Propose stream from %s: step %d failed", peer,
                                     request.step_id)
                    await context.abort(grpc.StatusCode.INTERNAL, "drafter failed on this step")
                    return
                if metrics is not None:
                    metrics.observe_step(request, response, time.perf_counter() - started)
                yield response
        finally:
            sweeper.cancel()
            self.tables.discard(table)
            if metrics is not None:
                metrics.open_streams.dec()
            proposer.close()  # returns shared draft KV blocks
            logger.info("Propose stream from %s closed", peer)


async def _sweep_idle(table: SequenceTable) -> None:
    while True:
        await asyncio.sleep(table.limits.seq_idle_timeout_s / 2)
        table.evict_idle()


def _check_bounds(info: ProposerInfo, request: specdec_pb2.ProposeRequest,
                  table: SequenceTable | None) -> None:
    """Refuses, before anything changes, what no verifier sends: duplicates, too many
    sequences, ids outside the vocabulary."""
    seq_ids = [update.seq_id for update in request.sequences]
    if len(set(seq_ids)) != len(seq_ids):
        raise InvalidRequestError(f"step {request.step_id}: a seq_id appears twice in sequences",
                                  param="sequences.seq_id")
    if table is not None and len(seq_ids) > table.limits.max_seqs_per_stream:
        raise InvalidRequestError(
            f"step {request.step_id}: {len(seq_ids)} sequences, more than this drafter's "
            f"--max-seqs-per-stream {table.limits.max_seqs_per_stream}", param="sequences")
    limit = token_id_limit(info)
    for update in request.sequences:
        if update.new_token_ids and (bad := max(update.new_token_ids)) >= limit:
            raise InvalidRequestError(
                f"seq {update.seq_id}: token id {bad} is outside the vocabulary (size {limit})",
                param=TOKEN_IDS_FIELD)
    if len(request.finished_outputs) > MAX_FINISHED_OUTPUTS_PER_MESSAGE:
        raise InvalidRequestError(
            f"step {request.step_id}: {len(request.finished_outputs)} finished outputs, more "
            f"than {MAX_FINISHED_OUTPUTS_PER_MESSAGE}", param=FINISHED_OUTPUTS_FIELD)
    for output in request.finished_outputs:
        for ids in (output.prompt_token_ids, output.output_token_ids):
            if ids and (bad := max(ids)) >= limit:
                raise InvalidRequestError(
                    f"finished output {output.seq_id}: token id {bad} is outside the "
                    f"vocabulary (size {limit})", param=FINISHED_OUTPUTS_FIELD)


def handle_propose_request(proposer: Proposer, request: specdec_pb2.ProposeRequest,
                           table: SequenceTable | None = None) -> specdec_pb2.ProposeResponse:
    """Applies one step's updates to `proposer` and drafts; raises InvalidRequestError if malformed.

    `table` (the stream's) bounds what the stream holds; without one only the checks apply.
    """
    steps = _propose_steps(proposer, request, table)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def handle_propose_request_sliced(proposer: Proposer, request: specdec_pb2.ProposeRequest,
                                        table: SequenceTable | None = None,
                                        ) -> specdec_pb2.ProposeResponse:
    """`handle_propose_request`, giving the event loop back between big updates."""
    steps = _propose_steps(proposer, request, table)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


def _propose_steps(proposer: Proposer, request: specdec_pb2.ProposeRequest,
                   table: SequenceTable | None,
                   ) -> Generator[None, None, specdec_pb2.ProposeResponse]:
    """handle_propose_request's work, pausing (yield) before each update that brings at
    least YIELD_BEFORE_TOKENS tokens; returns the response."""
    info = proposer.info
    _check_bounds(info, request, table)
    if request.finished_outputs and info.wants_finished_outputs:
        # Before finished_seq_ids: a method told of its verifier's outputs stops publishing
        # its own finished sequences (suffix_proposer: one path per output, never both).
        learner = cast(LearningProposer, proposer)
        max_len = max_model_len(info)
        for output in request.finished_outputs:
            if len(output.prompt_token_ids) + len(output.output_token_ids) > max_len:
                continue  # never drafted for here: not worth holding
            learner.learn(output.seq_id, output.prompt_token_ids, output.output_token_ids)
    for seq_id in request.finished_seq_ids:
        if table is not None:
            table.remove(seq_id)
        else:
            proposer.remove_sequence(seq_id)
    if table is not None:
        table.evict_idle()

    max_k = info.max_num_speculative_tokens
    max_len = max_model_len(info)
    response = specdec_pb2.ProposeResponse(step_id=request.step_id)
    propose_seq_ids: list[int] = []
    propose_counts: list[int] = []
    num_too_long = 0
    num_over_budget = 0
    # Tokens the stream holds, kept up to date below (a sum over its sequences, once; a
    # sequence evicted to make room is not subtracted, which errs on the safe side).
    num_held = table.num_tokens() if table is not None else 0
    for update in request.sequences:
        seq_id = update.seq_id
        num_new = len(update.new_token_ids)
        if num_new >= YIELD_BEFORE_TOKENS:
            yield
        if update.context_len > max_len:
            # Held by no one: its tokens are dropped, it is never drafted for.
            if table is None:
                proposer.remove_sequence(seq_id)
            elif seq_id in table.too_long:
                table.touch(seq_id)
                continue
            else:
                num_held -= proposer.context_len(seq_id) or 0
                table.mark_too_long(seq_id)
            num_too_long += 1
            continue
        known_len = proposer.context_len(seq_id)
        if table is not None:
            if seq_id in table.over_budget and update.context_len != num_new:
                table.touch(seq_id)  # refused; only a full context is tried again
                continue
            num_after = num_held - (known_len or 0) + update.context_len
            if num_after > table.limits.max_tokens_per_stream:
                table.mark_over_budget(seq_id)
                num_held -= known_len or 0
                num_over_budget += 1
                continue
            table.over_budget.discard(seq_id)
            num_held = num_after
        if update.context_len == num_new:
            hidden_states = _decode_hidden_states(info, update, 0)
            if table is not None:
                table.too_long.discard(seq_id)
                table.touch(seq_id)  # before add_sequence: evicting frees room first
            proposer.add_sequence(seq_id)
            proposer.append_tokens(seq_id, update.new_token_ids, hidden_states)
        elif known_len is not None and known_len + num_new == update.context_len:
            hidden_states = _decode_hidden_states(info, update, known_len)
            if table is not None:
                table.touch(seq_id)
            proposer.rollback(seq_id, update.num_accepted_tokens)
            proposer.append_tokens(seq_id, update.new_token_ids, hidden_states)
        else:
            if table is not None:
                table.remove(seq_id)
                num_held -= update.context_len  # counted above as if it were held
            else:
                proposer.remove_sequence(seq_id)
            response.drafts.add(seq_id=seq_id, needs_resync=True)
            continue
        num_tokens = min(update.num_speculative_tokens, max_k)
        if num_tokens > 0:
            propose_seq_ids.append(seq_id)
            propose_counts.append(num_tokens)
    if num_too_long:
        logger.warning("step %d: %d sequences longer than this drafter's max-model-len %d are "
                       "not drafted for (raise --max-model-len to the verifier's)",
                       request.step_id, num_too_long, max_len)
    if num_over_budget:
        assert table is not None
        logger.warning("step %d: %d sequences refused: the stream would hold more than "
                       "--max-tokens-per-stream %d tokens; they are not drafted for",
                       request.step_id, num_over_budget, table.limits.max_tokens_per_stream)

    if propose_seq_ids:
        for seq_id, proposal in zip(propose_seq_ids,
                                    proposer.propose(propose_seq_ids, propose_counts)):
            _drop_out_of_vocab(proposal, token_id_limit(info), seq_id)
            if not proposal.draft_token_ids:
                continue  # no draft: the verifier decodes one token for this sequence
            draft = response.drafts.add(seq_id=seq_id, draft_token_ids=proposal.draft_token_ids)
            if proposal.confidence:
                # One per sent token, in [0, 1] (NaN as 0): the verifier drops a malformed list.
                draft.confidence.extend(
                    0.0 if math.isnan(value) else min(1.0, max(0.0, value))
                    for value in proposal.confidence[:len(proposal.draft_token_ids)])
            if proposal.parents is not None:
                draft.draft_parents.extend(proposal.parents[:len(proposal.draft_token_ids)])
            if proposal.draft_probs is not None:
                # Imported here: only model methods get here; ngram starts without torch.
                from specdec.rpc.tensors import encode_tensor

                encode_tensor(proposal.draft_probs, draft.draft_probs)
    return response


def _drop_out_of_vocab(proposal: Proposal, limit: int, seq_id: int) -> None:
    """Cuts a draft at its first id outside the vocabulary: a method bug, never sent on."""
    ids = proposal.draft_token_ids
    keep = next((i for i, token_id in enumerate(ids) if not 0 <= token_id < limit), len(ids))
    if keep < len(ids):
        logger.error("seq %d: the method proposed token id %d, outside the vocabulary (size %d); "
                     "draft cut to %d tokens", seq_id, ids[keep], limit, keep)
        proposal.draft_token_ids = ids[:keep]
        if proposal.confidence is not None:
            proposal.confidence = proposal.confidence[:keep]
        if proposal.parents is not None:
            proposal.parents = proposal.parents[:keep]  # parents come first: still a tree
        if proposal.draft_probs is not None:
            proposal.draft_probs = proposal.draft_probs[:keep]


def _decode_hidden_states(info: ProposerInfo, update: specdec_pb2.SequenceUpdate,
                          known_len: int) -> torch.Tensor | None:
    """The update's target hidden-state rows, checked; None for methods that need none.

    A drafter holding known_len tokens holds rows for all but the last of them, so the update
    must bring rows for positions [max(known_len - 1, 0), context_len - 1).
    """
    if not info.hidden_state_layer_ids:
        return None  # ngram: whatever the verifier sent is ignored
    from specdec.rpc.tensors import decode_tensor

    num_rows = max(update.context_len - 1, 0) - max(known_len - 1, 0)
    width = info.hidden_state_width
    if not update.HasField("hidden_states"):
        if num_rows == 0:
            import torch

            return torch.empty(0, width)
        raise InvalidRequestError(
            f"seq {update.seq_id}: {HIDDEN_STATES_FIELD} missing; method {info.method!r} needs "
            f"{num_rows} rows of layers {list(info.hidden_state_layer_ids)}", param=HIDDEN_STATES_FIELD)
    try:
        return decode_tensor(update.hidden_states, field=HIDDEN_STATES_FIELD,
                             dtypes=_HIDDEN_STATE_DTYPES, shape=(num_rows, width or None))
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"seq {update.seq_id}: {exc.message} (rows cover context positions "
                                  f"[{max(known_len - 1, 0)}, {max(update.context_len - 1, 0)}))",
                                  param=HIDDEN_STATES_FIELD) from None
