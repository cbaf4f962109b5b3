"""One ProposeRequest applied to a stream's Proposer: its bounds checked, its updates
applied to the sequences (start, append, resync, too long, over budget), then the drafts
asked for; the rules are drafter_svc/servicer.py's docstring."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Generator
from typing import TYPE_CHECKING, cast

from drafter_svc.proposer import LearningProposer, Proposal, Proposer, ProposerInfo
from drafter_svc.sequence_table import SequenceTable, max_model_len, token_id_limit
from specdec.errors import InvalidRequestError
from specdec.v1 import specdec_pb2

if TYPE_CHECKING:
    import torch

HIDDEN_STATES_FIELD = "sequences.hidden_states"
TOKEN_IDS_FIELD = "sequences.new_token_ids"
FINISHED_OUTPUTS_FIELD = "finished_outputs"
# Far above what a verifier puts in one message (finished_outputs.MESSAGE_MAX_OUTPUTS, or
# a catch-up's share of its replay log, at most about 2**20 / 8).
MAX_FINISHED_OUTPUTS_PER_MESSAGE = 1 << 18
_HIDDEN_STATE_DTYPES = ("float32", "bfloat16", "float16")
# Updates bringing at least this many tokens give the event loop back before them.
YIELD_BEFORE_TOKENS = 512

logger = logging.getLogger(__name__)


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
    _check_bounds(proposer.info, request, table)
    _learn_finished_outputs(proposer, request)
    _drop_finished(proposer, request, table)
    response = specdec_pb2.ProposeResponse(step_id=request.step_id)
    updates = _UpdateApplier(proposer, table, response)
    for update in request.sequences:
        if len(update.new_token_ids) >= YIELD_BEFORE_TOKENS:
            yield
        updates.apply(update)
    updates.log_skipped(request.step_id)
    _add_drafts(proposer, response, updates.propose_seq_ids, updates.propose_counts)
    return response


def _learn_finished_outputs(proposer: Proposer, request: specdec_pb2.ProposeRequest) -> None:
    # Before finished_seq_ids: a method told of its verifier's outputs stops publishing
    # its own finished sequences (suffix_proposer: one path per output, never both).
    info = proposer.info
    if not (request.finished_outputs and info.wants_finished_outputs):
        return
    learner = cast(LearningProposer, proposer)
    max_len = max_model_len(info)
    for output in request.finished_outputs:
        if len(output.prompt_token_ids) + len(output.output_token_ids) > max_len:
            continue  # never drafted for here: not worth holding
        learner.learn(output.seq_id, output.prompt_token_ids, output.output_token_ids)


def _drop_finished(proposer: Proposer, request: specdec_pb2.ProposeRequest,
                   table: SequenceTable | None) -> None:
    """Forgets the finished sequences and, with a table, the idle ones."""
    for seq_id in request.finished_seq_ids:
        if table is not None:
            table.remove(seq_id)
        else:
            proposer.remove_sequence(seq_id)
    if table is not None:
        table.evict_idle()


class _UpdateApplier:
    """Applies one message's SequenceUpdates in order (start, append, resync, too long, over
    budget), keeping the stream's held tokens up to date, and collects the sequences to
    draft for with their draft lengths."""

    def __init__(self, proposer: Proposer, table: SequenceTable | None,
                 response: specdec_pb2.ProposeResponse) -> None:
        self.proposer = proposer
        self.table = table
        self.response = response
        self.info = proposer.info
        self.max_len = max_model_len(self.info)
        self.propose_seq_ids: list[int] = []
        self.propose_counts: list[int] = []
        self.num_too_long = 0
        self.num_over_budget = 0
        # Tokens the stream holds, kept up to date below (a sum over its sequences, once; a
        # sequence evicted to make room is not subtracted, which errs on the safe side).
        self.num_held = table.num_tokens() if table is not None else 0

    def apply(self, update: specdec_pb2.SequenceUpdate) -> None:
        if update.context_len > self.max_len:
            self._drop_too_long(update.seq_id)
            return
        known_len = self.proposer.context_len(update.seq_id)
        if self.table is not None and not self._fits_budget(self.table, update, known_len):
            return
        if not self._take_tokens(update, known_len):
            return
        num_tokens = min(update.num_speculative_tokens, self.info.max_num_speculative_tokens)
        if num_tokens > 0:
            self.propose_seq_ids.append(update.seq_id)
            self.propose_counts.append(num_tokens)

    def _drop_too_long(self, seq_id: int) -> None:
        """Held by no one: its tokens are dropped, it is never drafted for."""
        if self.table is None:
            self.proposer.remove_sequence(seq_id)
        elif seq_id in self.table.too_long:
            self.table.touch(seq_id)
            return
        else:
            self.num_held -= self.proposer.context_len(seq_id) or 0
            self.table.mark_too_long(seq_id)
        self.num_too_long += 1

    def _fits_budget(self, table: SequenceTable, update: specdec_pb2.SequenceUpdate,
                     known_len: int | None) -> bool:
        """Whether the update fits --max-tokens-per-stream; one that does not is refused."""
        seq_id = update.seq_id
        if seq_id in table.over_budget and update.context_len != len(update.new_token_ids):
            table.touch(seq_id)  # refused; only a full context is tried again
            return False
        num_after = self.num_held - (known_len or 0) + update.context_len
        if num_after > table.limits.max_tokens_per_stream:
            table.mark_over_budget(seq_id)
            self.num_held -= known_len or 0
            self.num_over_budget += 1
            return False
        table.over_budget.discard(seq_id)
        self.num_held = num_after
        return True

    def _take_tokens(self, update: specdec_pb2.SequenceUpdate, known_len: int | None) -> bool:
        """Starts or appends to the sequence; one that disagrees with what is held is
        dropped and answered needs_resync (False)."""
        seq_id, num_new, table = update.seq_id, len(update.new_token_ids), self.table
        if update.context_len == num_new:
            hidden_states = _decode_hidden_states(self.info, update, 0)
            if table is not None:
                table.too_long.discard(seq_id)
                table.touch(seq_id)  # before add_sequence: evicting frees room first
            self.proposer.add_sequence(seq_id)
            self.proposer.append_tokens(seq_id, update.new_token_ids, hidden_states)
        elif known_len is not None and known_len + num_new == update.context_len:
            hidden_states = _decode_hidden_states(self.info, update, known_len)
            if table is not None:
                table.touch(seq_id)
            self.proposer.rollback(seq_id, update.num_accepted_tokens)
            self.proposer.append_tokens(seq_id, update.new_token_ids, hidden_states)
        else:
            if table is not None:
                table.remove(seq_id)
                self.num_held -= update.context_len  # counted above as if it were held
            else:
                self.proposer.remove_sequence(seq_id)
            self.response.drafts.add(seq_id=seq_id, needs_resync=True)
            return False
        return True

    def log_skipped(self, step_id: int) -> None:
        if self.num_too_long:
            logger.warning("step %d: %d sequences longer than this drafter's max-model-len %d "
                           "are not drafted for (raise --max-model-len to the verifier's)",
                           step_id, self.num_too_long, self.max_len)
        if self.num_over_budget:
            assert self.table is not None
            logger.warning("step %d: %d sequences refused: the stream would hold more than "
                           "--max-tokens-per-stream %d tokens; they are not drafted for",
                           step_id, self.num_over_budget, self.table.limits.max_tokens_per_stream)


def _add_drafts(proposer: Proposer, response: specdec_pb2.ProposeResponse,
                seq_ids: list[int], counts: list[int]) -> None:
    """Asks the proposer for the drafts and puts them in the response."""
    if not seq_ids:
        return
    limit = token_id_limit(proposer.info)
    for seq_id, proposal in zip(seq_ids, proposer.propose(seq_ids, counts)):
        _drop_out_of_vocab(proposal, limit, seq_id)
        if not proposal.draft_token_ids:
            continue  # no draft: the verifier decodes one token for this sequence
        draft = response.drafts.add(seq_id=seq_id, draft_token_ids=proposal.draft_token_ids)
        if proposal.confidence:
            # One per sent token, in [0, 1] (NaN as 0): the verifier drops a malformed list.
            draft.confidence.extend(
                0.0 if math.isnan(value) else min(1.0, max(0.0, value))
                for value in proposal.confidence[:len(proposal.draft_token_ids)])
        if proposal.draft_probs is not None:
            # Imported here: only model methods get here; ngram starts without torch.
            from specdec.rpc.tensors import encode_tensor

            encode_tensor(proposal.draft_probs, draft.draft_probs)


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
