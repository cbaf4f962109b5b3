"""The verifier's client of the drafter replicas: one bidi stream each, one message per step.

Each engine step the engine calls `DrafterPool.propose` once. The pool sends ONE
ProposeRequest to every replica that holds some of the step's sequences, all at once,
waits at most `timeout_s`, and returns the drafts that arrived in time. A drafter can
cost speed, never correctness: a replica that is slow, down, refused or answering
garbage simply yields no drafts (each failure counted in `errors`, see drafter_errors),
and `propose` never raises.

Invariants:
- a sequence sticks to the replica it was assigned to (least loaded healthy one) until
  that replica goes down; then it is reassigned on its next step with a full resync
  (verifier_svc.drafting.sequence_placement);
- `SeqState.num_synced_tokens` tokens of the sequence's verified context are on its
  replica; each step sends only `token_ids[num_synced_tokens:]`. It is advanced when the
  message is queued: the stream is ordered, and a stream that breaks loses all the
  replica's state anyway (its sequences are dropped here and resynced elsewhere);
- responses are matched by step_id; a late one is discarded except for its
  needs_resync flags (the drafter restarts a sequence from any full context, so an
  extra resync is harmless).

Replicas come from `targets` ("host:port"); each host name is resolved at start and
every `resolve_interval_s`, one replica per address (specdec.rpc.replica_set), so a
compose service scaled to N drafters behind one name gives N replicas.

Drafters that learn across requests (GetInfo.wants_finished_outputs: suffix) get every
finished output, whichever replica drafted it (`record_finished_output`; the bounded log
and the cursors are in finished_outputs.py). New outputs ride on the replica's next step
message; a replica that gets no step message within `finished_flush_delay_s` (it drafts
for no running sequence) gets them in a message of their own. A replica that connects,
first or again, is sent the whole log first (the catch-up replay) and is given no new
sequences until it has answered it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from specdec.errors import DrafterMismatchError, InvalidRequestError
from specdec.rpc.address import parse_host_port
from specdec.rpc.grpc_server import CHANNEL_OPTIONS, client_keepalive_options
from specdec.rpc.replica_health import model_mismatch
from specdec.rpc.replica_set import ChannelOptions, ReplicaSet, Resolver, resolve_ips
from specdec.rpc.tensors import FLOAT_DTYPE_NAMES, decode_tensor, encode_tensor
from specdec.rpc.tls import GrpcTlsConfig
from specdec.v1 import specdec_pb2
from verifier_svc.drafting.drafter_errors import BAD_RESPONSE, TIMEOUT, DrafterErrors
from verifier_svc.drafting.drafter_replica import DrafterReplica
from verifier_svc.drafting.finished_outputs import (
    DEFAULT_FLUSH_DELAY_S,
    DEFAULT_MAX_OUTPUTS,
    DEFAULT_MAX_TOKENS,
    FinishedOutputSharing,
)
from verifier_svc.drafting.sequence_placement import SequencePlacement

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftRequest:
    seq_id: int
    token_ids: list[int]          # the whole verified context (prompt + output so far); read, never copied
    num_accepted_tokens: int      # of this sequence's previous draft
    num_speculative_tokens: int   # 0 = just sync state
    # Target hidden states of context positions [0, rows), [rows, width]; rows is
    # len(token_ids) - 1 once the sequence is in decode. None when not captured.
    hidden_states: torch.Tensor | None = None


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None    # [len(token_ids), vocab] or None
    # The drafter's per-token estimate in [0, 1] that the token is accepted given the ones
    # before it (ngram, suffix: drafter_svc/confidence.py); None when it sent none.
    confidence: list[float] | None = None
    # Tokens a grammar forced (the verifier's own draft, no drafter involved).
    forced: bool = False


class _StepMessages:
    """One step's message per replica concerned and, per replica, seq_id -> the number of
    draft tokens asked for."""

    def __init__(self, step_id: int) -> None:
        self.step_id = step_id
        self.messages: dict[DrafterReplica, specdec_pb2.ProposeRequest] = {}
        self.asked: dict[DrafterReplica, dict[int, int]] = {}

    def message_for(self, replica: DrafterReplica) -> specdec_pb2.ProposeRequest:
        message = self.messages.get(replica)
        if message is None:
            message = self.messages[replica] = specdec_pb2.ProposeRequest(step_id=self.step_id)
            self.asked[replica] = {}
        return message


class DrafterPool:
    def __init__(self, targets: list[str], *, resolve_interval_s: float = 10.0,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 10.0,
                 vocab_size: int, tokenizer_fingerprint: str,
                 tls: GrpcTlsConfig | None = None,
                 internal_token: str | None = None,
                 replay_max_outputs: int = DEFAULT_MAX_OUTPUTS,
                 replay_max_tokens: int = DEFAULT_MAX_TOKENS,
                 finished_flush_delay_s: float = DEFAULT_FLUSH_DELAY_S,
                 resolver: Resolver = resolve_ips) -> None:
        for target in targets:
            parse_host_port(target, "--drafter")  # a ConfigError for anything but host:port
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.vocab_size = vocab_size
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.tls = tls  # client side (CA, client certificate) of the drafter channels
        self.internal_token = internal_token  # sent on every call (specdec.rpc.internal_auth)
        self.channel_options = [
            *CHANNEL_OPTIONS,
            # Our own backoff decides when to retry; a shared subchannel stuck in gRPC's
            # reconnect backoff (up to 120 s) would make a restarted drafter look down.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", int(backoff_initial_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(backoff_initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(backoff_max_s * 1000)),
            # Notice a vanished drafter (container killed) within ~15 s; the drafter's
            # server accepts these pings (specdec.rpc.grpc_server: one setting for both ends).
            *client_keepalive_options(),
        ]
        # Failures by replica and kind (exported as specdec:drafter_errors_total).
        self.errors = DrafterErrors()
        self._replicas = ReplicaSet("drafter", targets, open_replica=self._open_replica,
                                    retire_replica=self._retire_replica, tls=tls,
                                    resolver=resolver, resolve_interval_s=resolve_interval_s)
        self._placement = SequencePlacement()
        # The target layers every replica needs (GetInfo), fixed by the first replica
        # accepted; () when none are needed, None until a replica has connected.
        self.hidden_state_layer_ids: tuple[int, ...] | None = None
        self._step_id = 0
        self.sharing = FinishedOutputSharing(lambda: self.replicas,
                                             self._next_step_id, replay_max_outputs,
                                             replay_max_tokens, finished_flush_delay_s)

    async def start(self) -> None:
        """Resolves the targets and starts connecting; does not wait for any replica."""
        await self._replicas.start()

    async def close(self) -> None:
        self.sharing.close()
        await self._replicas.close()
        await asyncio.gather(*(replica.close() for replica in self.replicas))
        self._placement.clear()

    @property
    def replicas(self) -> list[DrafterReplica]:
        """Every replica, healthy or not, by --drafter and slot."""
        return self._replicas.replicas

    def _open_replica(self, address: str, channel_options: ChannelOptions) -> DrafterReplica:
        replica = DrafterReplica(self, address, channel_options)
        replica.start()
        return replica

    async def _retire_replica(self, replica: DrafterReplica) -> None:
        """Gone from DNS: its stream half-closes (the drafter drops its state) and its
        sequences move on their next step."""
        await replica.close()
        self.errors.forget(replica.address)

    def num_healthy(self) -> int:
        return sum(replica.healthy for replica in self.replicas)

    async def wait_for_healthy(self, num_replicas: int = 1, timeout_s: float = 10.0) -> bool:
        """Waits until at least num_replicas replicas are healthy; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.num_healthy() < num_replicas:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def propose(self, requests: list[DraftRequest], finished_seq_ids: list[int],
                      timeout_s: float) -> dict[int, Draft]:
        """Drafts for the sequences whose replica answered within timeout_s; never raises."""
        try:
            return await self._propose(requests, finished_seq_ids, timeout_s)
        except Exception:
            logger.exception("drafter pool: propose failed; no drafts this step")
            return {}

    def sync(self, requests: list[DraftRequest]) -> None:
        """Sends these sequences' contexts to their replicas without asking for drafts or
        waiting for an answer (never raises). The engine syncs a new request's prompt as its
        prefill starts, so the drafter takes it in (builds its suffix trie, say) while the
        verifier prefills, and the first ask carries only the tokens verified since."""
        try:
            self._send(self._next_step_id(), requests, [])
        except Exception:
            logger.exception("drafter pool: sync failed; the next ask sends the whole context")

    async def _propose(self, requests: list[DraftRequest], finished_seq_ids: list[int],
                       timeout_s: float) -> dict[int, Draft]:
        step_id = self._next_step_id()
        waiting, asked = self._send(step_id, requests, finished_seq_ids)
        if not waiting:
            return {}
        return await self._await_drafts(step_id, waiting, asked, timeout_s)

    def _send(self, step_id: int, requests: list[DraftRequest], finished_seq_ids: list[int],
              ) -> tuple[dict[asyncio.Future[specdec_pb2.ProposeResponse | None], DrafterReplica],
                         dict[DrafterReplica, dict[int, int]]]:
        """Queues one message per replica concerned; returns the futures of the answers
        wanted (with their replicas) and, per replica, the tokens asked for by sequence."""
        step = _StepMessages(step_id)
        for seq_id in finished_seq_ids:
            state = self._placement.finish(seq_id)
            if state is not None:
                if state.replica.healthy:
                    step.message_for(state.replica).finished_seq_ids.append(seq_id)
        for request in requests:
            self._add_update(step, request)
        for replica, message in step.messages.items():
            self.sharing.piggyback(replica, message)

        waiting: dict[asyncio.Future[specdec_pb2.ProposeResponse | None], DrafterReplica] = {}
        for replica, message in step.messages.items():
            future = replica.send(message, wants_response=bool(step.asked[replica]))
            if future is not None:
                waiting[future] = replica
        return waiting, step.asked

    def _add_update(self, step: _StepMessages, request: DraftRequest) -> None:
        """Adds request's update (the tokens and hidden states its replica lacks) to the
        message for its replica, assigning one first where it has none healthy."""
        state = self._placement.get(request.seq_id)
        if state is None or not state.replica.healthy:
            state = self._placement.assign(request.seq_id, self.replicas)
            if state is None:
                return  # no healthy replica: no drafts this step
        replica = state.replica
        token_ids = request.token_ids
        if state.num_synced_tokens > len(token_ids):
            state.num_synced_tokens = 0  # the context shrank (should not happen): resync
        hidden_rows = None
        if self.hidden_state_layer_ids:
            # Rows cover every context position but the last (see the .proto).
            num_rows = len(token_ids) - 1
            hidden = request.hidden_states
            if hidden is None or hidden.shape[0] < num_rows:
                return  # states not captured for this sequence: it cannot be drafted
            if state.num_synced_tokens == 0:
                state.num_synced_hidden_rows = 0
            hidden_rows = hidden[state.num_synced_hidden_rows:num_rows]
            state.num_synced_hidden_rows = num_rows
        num_tokens = min(max(request.num_speculative_tokens, 0),
                         replica.max_num_speculative_tokens)
        update = step.message_for(replica).sequences.add(
            seq_id=request.seq_id,
            new_token_ids=token_ids[state.num_synced_tokens:],
            num_accepted_tokens=max(request.num_accepted_tokens, 0),
            context_len=len(token_ids),
            num_speculative_tokens=num_tokens,
        )
        if hidden_rows is not None:
            encode_tensor(hidden_rows, update.hidden_states)
        state.num_synced_tokens = len(token_ids)
        if num_tokens > 0:
            step.asked[replica][request.seq_id] = num_tokens

    async def _await_drafts(self, step_id: int, waiting: dict[asyncio.Future[specdec_pb2.ProposeResponse | None],
                                                               DrafterReplica],
                            asked: dict[DrafterReplica, dict[int, int]], timeout_s: float,
                            ) -> dict[int, Draft]:
        done, late = await asyncio.wait(waiting, timeout=timeout_s)
        for future in late:
            waiting[future].forget(step_id)
            # INFO: late drafts cost speed only, and a loaded drafter is late routinely.
            self.errors.record(waiting[future].address, TIMEOUT,
                               f"no drafts within the {timeout_s * 1000:g} ms deadline; the "
                               "step ran without them", logging.INFO)
        drafts: dict[int, Draft] = {}
        for future in done:
            response = future.result()
            if response is not None:  # None: the replica failed during the step
                replica = waiting[future]
                self._collect(replica, response, asked[replica], drafts)
        return drafts

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def record_finished_output(self, seq_id: int, prompt_token_ids: list[int],
                               output_token_ids: list[int]) -> None:
        """A sequence finished: every replica that learns across requests will get its output
        (never raises: sharing costs speed at worst)."""
        self.sharing.record(seq_id, prompt_token_ids, output_token_ids)

    def replica_connected(self, replica: DrafterReplica) -> None:
        self.sharing.replica_connected(replica)

    def _collect(self, replica: DrafterReplica, response: specdec_pb2.ProposeResponse,
                 asked: dict[int, int], drafts: dict[int, Draft]) -> None:
        """Validates one in-time response; bad drafts are dropped, counted and (rate-limited)
        logged."""
        for sequence_draft in response.drafts:
            seq_id = sequence_draft.seq_id
            if sequence_draft.needs_resync:
                self.mark_needs_resync(replica, seq_id)
                continue
            token_ids = list(sequence_draft.draft_token_ids)
            num_asked = asked.get(seq_id)
            if not token_ids or seq_id in drafts:
                continue
            if num_asked is None or len(token_ids) > num_asked:
                self.errors.record(replica.address, BAD_RESPONSE,
                                   f"dropped a draft for seq {seq_id}: {len(token_ids)} "
                                   f"tokens, asked for {num_asked or 0}")
                continue
            if self.vocab_size and max(token_ids) >= self.vocab_size:
                self.errors.record(replica.address, BAD_RESPONSE,
                                   f"dropped a draft for seq {seq_id}: token id "
                                   f"{max(token_ids)} is outside the vocabulary (size "
                                   f"{self.vocab_size})")
                continue
            probs = None
            if sequence_draft.HasField("draft_probs"):
                probs = _decode_probs(sequence_draft.draft_probs, len(token_ids), self.vocab_size)
                if probs is None:
                    self.errors.record(replica.address, BAD_RESPONSE,
                                       f"dropped a draft for seq {seq_id}: malformed draft_probs")
                    continue
            drafts[seq_id] = Draft(token_ids, probs,
                                   self._confidence(replica, seq_id, sequence_draft, token_ids))

    def _confidence(self, replica: DrafterReplica, seq_id: int,
                    sequence_draft: specdec_pb2.SequenceDraft, token_ids: list[int],
                    ) -> list[float] | None:
        """The draft's confidence, or None when absent or malformed (the draft is kept)."""
        if not sequence_draft.confidence:
            return None
        values = list(sequence_draft.confidence)
        if len(values) != len(token_ids) or not all(0.0 <= value <= 1.0 for value in values):
            self.errors.record(replica.address, BAD_RESPONSE,
                               f"ignored the confidence of a draft for seq {seq_id}: "
                               f"{len(values)} values for {len(token_ids)} tokens, or some "
                               "outside [0, 1]")
            return None
        return values

    def mark_needs_resync(self, replica: DrafterReplica, seq_id: int) -> None:
        self._placement.needs_resync(replica, seq_id)

    def check_info(self, info: specdec_pb2.DrafterInfo) -> DrafterMismatchError | None:
        """Why a drafter cannot serve this verifier, or None when it can."""
        problems = model_mismatch(info, vocab_size=self.vocab_size,
                                  tokenizer_fingerprint=self.tokenizer_fingerprint,
                                  ours="verifier")
        if problems:
            return DrafterMismatchError("drafter built for another model: " + "; ".join(problems))
        layer_ids = tuple(info.hidden_state_layer_ids)
        if self.hidden_state_layer_ids is None:
            self.hidden_state_layer_ids = layer_ids
        elif layer_ids != self.hidden_state_layer_ids:
            return DrafterMismatchError(
                f"drafter method {info.method!r} needs target hidden states of layers "
                f"{list(layer_ids)}, but the replicas already serving need "
                f"{list(self.hidden_state_layer_ids)}")
        return None

    def drop_replica_sequences(self, replica: DrafterReplica) -> None:
        """The replica lost its stream: its sequences get reassigned on their next step."""
        self._placement.drop_replica(replica)


def _decode_probs(message: specdec_pb2.Tensor, num_tokens: int, vocab_size: int,
                  ) -> torch.Tensor | None:
    """[num_tokens, vocab] float32 probabilities, or None when the message is malformed."""
    try:
        probs = decode_tensor(message, field="draft_probs", dtypes=FLOAT_DTYPE_NAMES,
                              shape=(num_tokens, vocab_size or None))
    except InvalidRequestError:
        return None
    return probs.float() if probs.shape[1] else None


