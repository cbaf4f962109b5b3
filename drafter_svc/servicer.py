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
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

from typing import TYPE_CHECKING

import grpc

from drafter_svc.proposer import Proposer, ProposerInfo
from specdec.errors import InvalidRequestError, SpecdecError
from specdec.grpc_status import error_details, status_for
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

if TYPE_CHECKING:
    import torch

    from drafter_svc.metrics import DrafterMetrics

HIDDEN_STATES_FIELD = "sequences.hidden_states"
_HIDDEN_STATE_DTYPES = ("float32", "bfloat16", "float16")

logger = logging.getLogger(__name__)


class DrafterServicer(specdec_pb2_grpc.DrafterServicer):
    def __init__(self, proposer_factory: Callable[[], Proposer], info: ProposerInfo,
                 metrics: DrafterMetrics | None = None) -> None:
        self._proposer_factory = proposer_factory
        self._info = info
        self._metrics = metrics

    async def GetInfo(self, request: specdec_pb2.GetDrafterInfoRequest,
                      context: grpc.aio.ServicerContext) -> specdec_pb2.DrafterInfo:
        info = self._info
        return specdec_pb2.DrafterInfo(
            method=info.method,
            max_num_speculative_tokens=info.max_num_speculative_tokens,
            hidden_state_layer_ids=list(info.hidden_state_layer_ids),
            vocab_size=info.vocab_size,
            tokenizer_fingerprint=info.tokenizer_fingerprint,
        )

    async def Propose(self, request_iterator: AsyncIterator[specdec_pb2.ProposeRequest],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[specdec_pb2.ProposeResponse]:
        proposer = self._proposer_factory()
        peer = context.peer()
        logger.info("Propose stream opened by %s", peer)
        metrics = self._metrics
        if metrics is not None:
            metrics.open_streams.inc()
        try:
            async for request in request_iterator:
                started = time.perf_counter()
                try:
                    response = handle_propose_request(proposer, request)
                except SpecdecError as exc:
                    logger.warning("Propose stream from %s: %s", peer, exc.message)
                    await context.abort(status_for(exc), error_details(exc))
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
            if metrics is not None:
                metrics.open_streams.dec()
            proposer.close()  # returns shared draft KV blocks
            logger.info("Propose stream from %s closed", peer)


def handle_propose_request(proposer: Proposer,
                           request: specdec_pb2.ProposeRequest) -> specdec_pb2.ProposeResponse:
    """Applies one step's updates to `proposer` and drafts; raises InvalidRequestError if malformed."""
    seq_ids = [update.seq_id for update in request.sequences]
    if len(set(seq_ids)) != len(seq_ids):
        raise InvalidRequestError(f"step {request.step_id}: a seq_id appears twice in sequences",
                                  param="sequences.seq_id")
    for seq_id in request.finished_seq_ids:
        proposer.remove_sequence(seq_id)

    max_k = proposer.info.max_num_speculative_tokens
    response = specdec_pb2.ProposeResponse(step_id=request.step_id)
    propose_seq_ids: list[int] = []
    propose_counts: list[int] = []
    for update in request.sequences:
        seq_id = update.seq_id
        num_new = len(update.new_token_ids)
        known_len = proposer.context_len(seq_id)
        if update.context_len == num_new:
            hidden_states = _decode_hidden_states(proposer.info, update, 0)
            proposer.add_sequence(seq_id)
            proposer.append_tokens(seq_id, update.new_token_ids, hidden_states)
        elif known_len is not None and known_len + num_new == update.context_len:
            hidden_states = _decode_hidden_states(proposer.info, update, known_len)
            proposer.rollback(seq_id, update.num_accepted_tokens)
            proposer.append_tokens(seq_id, update.new_token_ids, hidden_states)
        else:
            proposer.remove_sequence(seq_id)
            response.drafts.add(seq_id=seq_id, needs_resync=True)
            continue
        num_tokens = min(update.num_speculative_tokens, max_k)
        if num_tokens > 0:
            propose_seq_ids.append(seq_id)
            propose_counts.append(num_tokens)

    if propose_seq_ids:
        for seq_id, proposal in zip(propose_seq_ids,
                                    proposer.propose(propose_seq_ids, propose_counts)):
            if not proposal.draft_token_ids:
                continue  # no draft: the verifier decodes one token for this sequence
            draft = response.drafts.add(seq_id=seq_id, draft_token_ids=proposal.draft_token_ids)
            if proposal.draft_probs is not None:
                # Imported here: only model methods get here; ngram starts without torch.
                from specdec.tensors import encode_tensor

                encode_tensor(proposal.draft_probs, draft.draft_probs)
    return response


def _decode_hidden_states(info: ProposerInfo, update: specdec_pb2.SequenceUpdate,
                          known_len: int) -> torch.Tensor | None:
    """The update's target hidden-state rows, checked; None for methods that need none.

    A drafter holding known_len tokens holds rows for all but the last of them, so the update
    must bring rows for positions [max(known_len - 1, 0), context_len - 1).
    """
    if not info.hidden_state_layer_ids:
        return None  # ngram: whatever the verifier sent is ignored
    from specdec.tensors import decode_tensor

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
