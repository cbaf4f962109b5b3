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
