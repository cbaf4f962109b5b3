"""The verifier's log of finished outputs, shared with drafters that learn across requests.

Suffix decoding drafts from earlier responses. With several drafter replicas each would
learn only from the sequences it happened to draft, so the verifier (which sees every
finished sequence) sends each finished output to EVERY replica whose GetInfo says
`wants_finished_outputs` (protos: ProposeRequest.finished_outputs).

The log is the single copy: a FIFO of the most recent outputs, bounded by count AND by
tokens (`max_outputs`, `max_tokens`; the oldest are dropped first). Each replica holds
only a cursor into it (the number of the last entry queued for it), so what is still to be
sent to a replica is "the entries after its cursor": no per-replica queue, and nothing
grows for a replica that is down. A replica that (re)connects gets its cursor set before
the oldest entry: it catches up from this bounded replay, then follows the new entries.
An entry dropped from the log before a slow replica got it is simply missed (a lost draft
source, never a wrong draft).

Each entry carries the output and the prompt's last `PROMPT_TAIL_TOKENS` tokens (what the
output continues; suffix decoding holds the output behind the last few of them, its
lead-in: drafter_svc/suffix_proposer.py).
Its wire id is the engine's seq_id tagged with a random per-log 32-bit prefix, so the ids
of two verifiers, or of one verifier before and after a restart, do not collide: a drafter
uses them to skip an output it already holds (a replay after a mere stream reconnect).
"""

from __future__ import annotations

import asyncio
import logging
import random
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec.errors import ConfigError
from specdec.v1 import specdec_pb2
from verifier_svc.drafting.drafter_replica import DrafterReplica

logger = logging.getLogger(__name__)

# Defaults: as many outputs as suffix decoding's global tree holds by default
# (suffix_decoding_max_cached_requests), and few enough tokens that a joining replica
# inserts the whole replay in about a second of drafter CPU.
DEFAULT_MAX_OUTPUTS = 10000
DEFAULT_MAX_TOKENS = 1 << 18
# Far above any sane setting; keeps the drafter's per-message limit meaningful.
MAX_OUTPUTS_LIMIT = 1 << 20
PROMPT_TAIL_TOKENS = 64
# How long new outputs may wait for a replica's next step message before they are sent in
# one of their own: a busy replica gets them piggybacked, an idle one within this delay.
DEFAULT_FLUSH_DELAY_S = 0.1
# One message carries at most this many outputs / tokens, unless a catch-up needs larger
# ones: it goes in at most about 2 x CATCH_UP_MESSAGES messages, well within the
# replica's budget of unanswered messages (drafter_replica._MAX_UNANSWERED_STEPS).
MESSAGE_MAX_OUTPUTS = 1024
MESSAGE_MAX_TOKENS = 1 << 16
CATCH_UP_MESSAGES = 8


@dataclass(slots=True)
class LogEntry:
    number: int          # 1, 2, ... in the order recorded
    output_id: int       # the wire id (FinishedOutput.seq_id)
    prompt_tail: array
    output: array

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tail) + len(self.output)


class FinishedOutputLog:
    """The bounded replay of recent finished outputs and the cursors' arithmetic."""

    def __init__(self, max_outputs: int = DEFAULT_MAX_OUTPUTS,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if not 0 <= max_outputs <= MAX_OUTPUTS_LIMIT:
            raise ConfigError(f"the finished-output replay holds 0..{MAX_OUTPUTS_LIMIT} "
                              f"outputs, got {max_outputs}", param="replay_max_outputs")
        if max_tokens < 0:
            raise ConfigError(f"the finished-output replay's token bound must be >= 0, got "
                              f"{max_tokens}", param="replay_max_tokens")
        self.max_outputs = max_outputs
        self.max_tokens = max_tokens
        self._entries: deque[LogEntry] = deque()
        self.num_tokens = 0
        self._last_number = 0
        self._id_prefix = random.getrandbits(32) << 32

    @property
    def enabled(self) -> bool:
        return self.max_outputs > 0 and self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, seq_id: int, prompt_token_ids: Sequence[int],
               output_token_ids: Sequence[int]) -> None:
        if not self.enabled or not output_token_ids:
            return
        entry = LogEntry(self._last_number + 1, self._id_prefix | (seq_id & 0xFFFFFFFF),
                         array("I", prompt_token_ids[-PROMPT_TAIL_TOKENS:]),
                         array("I", output_token_ids))
        if entry.num_tokens > self.max_tokens:
            logger.debug("finished output of seq %d (%d tokens) exceeds the replay's %d "
                         "tokens: not shared", seq_id, entry.num_tokens, self.max_tokens)
            return
        self._last_number = entry.number
        self._entries.append(entry)
        self.num_tokens += entry.num_tokens
        while len(self._entries) > self.max_outputs or self.num_tokens > self.max_tokens:
            self.num_tokens -= self._entries.popleft().num_tokens

    def catch_up_cursor(self) -> int:
        """The cursor of a replica that has nothing yet: before the oldest entry held."""
        return self._entries[0].number - 1 if self._entries else self._last_number

    def head(self) -> int:
        """The cursor of a replica that has everything."""
        return self._last_number

    def has_after(self, cursor: int) -> bool:
        return self._last_number > cursor

    def messages_after(self, cursor: int, max_messages: int | None = None,
                       ) -> list[list[LogEntry]]:
        """The entries after `cursor`, split into messages' worth (see the constants).

        With max_messages, messages grow so that all entries fit in about twice that many
        (greedy packing; the count bound and the token bound each close at most about
        max_messages of them); without, every message keeps to the default size.
        """
        pending: list[LogEntry] = []
        for entry in reversed(self._entries):  # the pending ones are the newest
            if entry.number <= cursor:
                break
            pending.append(entry)
        pending.reverse()
        if not pending:
            return []
        max_count, max_tokens = MESSAGE_MAX_OUTPUTS, MESSAGE_MAX_TOKENS
        if max_messages is not None:
            total_tokens = sum(entry.num_tokens for entry in pending)
            max_count = max(max_count, -(-len(pending) // max_messages))
            max_tokens = max(max_tokens, 2 * -(-total_tokens // max_messages))
        messages: list[list[LogEntry]] = [[]]
        tokens = 0
        for entry in pending:
            current = messages[-1]
            if current and (len(current) >= max_count or tokens + entry.num_tokens > max_tokens):
                current = []
                messages.append(current)
                tokens = 0
            current.append(entry)
            tokens += entry.num_tokens
        return messages


def add_to_message(message: specdec_pb2.ProposeRequest, entries: list[LogEntry]) -> None:
    for entry in entries:
        output = message.finished_outputs.add(seq_id=entry.output_id)
        output.prompt_token_ids.extend(entry.prompt_tail)
        output.output_token_ids.extend(entry.output)


class FinishedOutputSharing:
    """The pool's side of sharing: the log, each replica's cursor, catch-up and flushing.

    New outputs ride on a replica's next step message (`piggyback`); a flush timer sends
    what no step message carried within `flush_delay_s`. A replica that connects is sent the
    whole log first (`replica_connected`) and counts as `catching_up`, given no new
    sequences, until it has answered that replay.
    """

    def __init__(self, replicas: Callable[[], list[DrafterReplica]],
                 next_step_id: Callable[[], int], max_outputs: int = DEFAULT_MAX_OUTPUTS,
                 max_tokens: int = DEFAULT_MAX_TOKENS,
                 flush_delay_s: float = DEFAULT_FLUSH_DELAY_S) -> None:
        self._replicas = replicas
        self._next_step_id = next_step_id
        self.log = FinishedOutputLog(max_outputs, max_tokens)
        self.flush_delay_s = flush_delay_s
        # Outputs are kept only once a replica that learns from them has connected: a pool
        # of ngram drafters keeps nothing.
        self._learning_replica_seen = False
        self._flush_handle: asyncio.TimerHandle | None = None

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None

    def record(self, seq_id: int, prompt_token_ids: Sequence[int],
               output_token_ids: Sequence[int]) -> None:
        """Never raises: sharing costs speed at worst."""
        if not self._learning_replica_seen:
            return
        try:
            self.log.append(seq_id, prompt_token_ids, output_token_ids)
            self._schedule_flush()
        except Exception:
            logger.exception("recording the finished output of seq %d failed", seq_id)

    def replica_connected(self, replica: DrafterReplica) -> None:
        """A fresh stream to `replica`: a learning one first gets the whole replay."""
        if not replica.wants_finished_outputs:
            return
        self._learning_replica_seen = True
        log = self.log
        replica.outputs_cursor = log.catch_up_cursor()
        if not log.has_after(replica.outputs_cursor):
            return
        logger.info("drafter %s: catching up on %d finished outputs (%d tokens)",
                    replica.address, len(log), log.num_tokens)
        replica.catching_up = True
        done = self._send(replica, CATCH_UP_MESSAGES, wants_response=True)
        if done is None:
            replica.catching_up = False
            return
        generation = replica.generation

        def caught_up(future: asyncio.Future[specdec_pb2.ProposeResponse | None]) -> None:
            if replica.generation != generation or future.cancelled() or future.result() is None:
                return  # that stream is gone; the next one starts its own catch-up
            replica.catching_up = False
            logger.info("drafter %s: caught up", replica.address)
            if log.has_after(replica.outputs_cursor):
                self._schedule_flush()

        done.add_done_callback(caught_up)

    def piggyback(self, replica: DrafterReplica, message: specdec_pb2.ProposeRequest) -> None:
        """Adds the replica's new outputs (one message's worth) to its step message."""
        if not self._learns_now(replica):
            return
        entries = self.log.messages_after(replica.outputs_cursor)[0]
        add_to_message(message, entries)
        replica.outputs_cursor = entries[-1].number
        if self.log.has_after(replica.outputs_cursor):
            self._schedule_flush()  # a burst: the rest goes with the flush

    def _learns_now(self, replica: DrafterReplica) -> bool:
        return (replica.wants_finished_outputs and replica.healthy and not replica.catching_up
                and self.log.has_after(replica.outputs_cursor))

    def _send(self, replica: DrafterReplica, max_messages: int | None = None,
              wants_response: bool = False,
              ) -> asyncio.Future[specdec_pb2.ProposeResponse | None] | None:
        """Sends the replica's pending outputs in messages of their own (no sequences); with
        wants_response, returns the future of the last one's answer (None: not sent)."""
        batches = self.log.messages_after(replica.outputs_cursor, max_messages)
        future = None
        for index, entries in enumerate(batches):
            if not replica.healthy:
                return None  # down: it catches up when it reconnects
            message = specdec_pb2.ProposeRequest(step_id=self._next_step_id())
            add_to_message(message, entries)
            future = replica.send(message, wants_response=wants_response
                                  and index == len(batches) - 1)
            replica.outputs_cursor = entries[-1].number
        return future

    def _schedule_flush(self) -> None:
        if self._flush_handle is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): the next step messages carry them
        self._flush_handle = loop.call_later(self.flush_delay_s, self._flush)

    def _flush(self) -> None:
        """Sends pending outputs to the replicas no step message carried them to."""
        self._flush_handle = None
        for replica in self._replicas():
            if self._learns_now(replica):
                self._send(replica)
