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

What a stream holds is drafter_svc/sequence_table.py's; applying one message,
drafter_svc/propose_request.py's.

Big messages do not stall the other streams: a message's updates are applied one sequence
at a time, the event loop free before each that brings many tokens (a suffix trie over an
8,000-token prompt is ~60 ms of Python), so other streams' drafts keep their deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from drafter_svc.propose_request import handle_propose_request_sliced
from drafter_svc.proposer import Proposer, ProposerInfo
from drafter_svc.sequence_table import SequenceTable, StreamLimits
from specdec.errors import OverloadedError, SpecdecError
from specdec.rpc.grpc_status import abort_with
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

if TYPE_CHECKING:
    from drafter_svc.metrics import DrafterMetrics

logger = logging.getLogger(__name__)


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
