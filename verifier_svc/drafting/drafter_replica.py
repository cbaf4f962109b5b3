"""One drafter replica as the verifier sees it: a channel, one Propose stream, a health flag.

The replica checks the drafter's GetInfo with its pool before opening the stream,
reconnects with exponential backoff after any failure, and reconnects a stream that
stopped answering. Its health is judged on evidence (specdec.rpc.replica_health): the
stream open is up; a failed connect, a broken stream or a refusal is down. When it goes
down, its pool forgets the replica's sequences, which are reassigned and resynced on
their next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import grpc

from specdec.errors import DrafterMismatchError
from specdec.rpc.replica_health import ReplicaHealth
from specdec.rpc.tls import open_channel
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.drafting.drafter_errors import (
    REFUSED,
    STREAM_ERROR,
    UNAVAILABLE,
    DrafterErrors,
)

if TYPE_CHECKING:
    from specdec.rpc.tls import GrpcTlsConfig

logger = logging.getLogger(__name__)

_GET_INFO_TIMEOUT_S = 5.0
# Steps sent but not yet answered before a replica counts as stuck and is reconnected.
_MAX_UNANSWERED_STEPS = 32


class ReplicaOwner(Protocol):
    """What a replica needs of its pool (`DrafterPool` is one): connection settings, the
    drafter check, error counts, and the hooks that move its sequences elsewhere."""

    tls: GrpcTlsConfig | None
    internal_token: str | None
    backoff_initial_s: float
    backoff_max_s: float
    errors: DrafterErrors

    @property  # read-only: the pool's list of (name, int) options is one
    def channel_options(self) -> Sequence[tuple[str, object]]: ...

    def check_info(self, info: specdec_pb2.DrafterInfo) -> DrafterMismatchError | None: ...

    def mark_needs_resync(self, replica: DrafterReplica, seq_id: int) -> None: ...

    def drop_replica_sequences(self, replica: DrafterReplica) -> None: ...

    def replica_connected(self, replica: DrafterReplica) -> None: ...


class DrafterReplica:
    """One drafter address: a channel, one long-lived Propose stream, a health flag."""

    def __init__(self, pool: ReplicaOwner, address: str,
                 channel_options: Sequence[tuple[str, object]] = ()) -> None:
        self.pool = pool
        self.address = address
        # The pool's options and this address's own (specdec.rpc.replica_set).
        self.channel_options = [*pool.channel_options, *channel_options]
        self.health = ReplicaHealth()
        self.max_num_speculative_tokens = 0
        self.seq_ids: set[int] = set()
        # Finished-output sharing (verifier_svc/drafting/finished_outputs.py): whether the
        # drafter learns from them (GetInfo), the last log entry queued for it, and whether
        # its catch-up replay is still unanswered (it gets no new sequences meanwhile).
        self.wants_finished_outputs = False
        self.outputs_cursor = 0
        self.catching_up = False
        # Bumped on every connect: a callback from an earlier stream must not act on this one.
        self.generation = 0
        self._outbox: asyncio.Queue[specdec_pb2.ProposeRequest | None] = asyncio.Queue()
        self._pending: dict[int, asyncio.Future[specdec_pb2.ProposeResponse | None]] = {}
        self._num_unanswered = 0
        self._call: grpc.aio.StreamStreamCall | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"drafter-replica-{self.address}")

    async def close(self) -> None:
        self._closing = True
        self._outbox.put_nowait(None)  # half-close the stream: the drafter drops our state
        await asyncio.sleep(0)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def send(self, message: specdec_pb2.ProposeRequest, wants_response: bool,
             ) -> asyncio.Future[specdec_pb2.ProposeResponse | None] | None:
        """Queues one step's message; returns the future of its response, if one is wanted."""
        if not self.healthy:
            return None
        if self._num_unanswered >= _MAX_UNANSWERED_STEPS and self._call is not None:
            self.pool.errors.record(self.address, STREAM_ERROR, f"has not answered "
                                    f"{self._num_unanswered} steps; reconnecting")
            self._call.cancel()
            return None
        self._num_unanswered += 1
        self._outbox.put_nowait(message)
        if not wants_response:
            return None
        future: asyncio.Future[specdec_pb2.ProposeResponse | None] = (
            asyncio.get_running_loop().create_future())
        self._pending[message.step_id] = future
        return future

    def forget(self, step_id: int) -> None:
        future = self._pending.pop(step_id, None)
        if future is not None and not future.done():
            future.cancel()

    async def _run(self) -> None:
        backoff_s = self.pool.backoff_initial_s
        was_up = True  # the first failure is logged, repeats at DEBUG
        # A drafter never reached yet is most likely still starting (a stack starts all
        # its services at once): that is INFO; losing one that served is a WARNING.
        ever_connected = False
        while True:
            channel = open_channel(self.pool.tls, self.address, self.channel_options,
                                   internal_token=self.pool.internal_token)
            try:
                async for _ in self._serve(channel):
                    backoff_s = self.pool.backoff_initial_s
                    was_up = ever_connected = True
                raise ConnectionError("the drafter ended the stream")
            except DrafterMismatchError as exc:
                # ERROR once per distinct reason; the periodic re-checks repeat it at DEBUG.
                self.pool.errors.record(
                    self.address, REFUSED, f"refused: {exc.message}; serving without it",
                    logging.ERROR if self.health.refusal_is_new(exc.message) else logging.DEBUG)
                backoff_s = self.pool.backoff_max_s
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if self._closing or (current is not None and current.cancelling()):
                    raise
                # Our own call.cancel() (a stuck replica, counted then): reconnect.
                logger.debug("drafter %s: stream cancelled; reconnecting", self.address)
            except Exception as exc:
                # Counted by where it failed: an open stream (e.g. a GOAWAY), or connecting.
                # A drafter still down after a failure logged already repeats at DEBUG.
                kind, what = ((STREAM_ERROR, "stream broke") if self.healthy
                              else (UNAVAILABLE, "unavailable"))
                self.pool.errors.record(
                    self.address, kind, f"{what} ({_describe(exc)}); retrying in "
                    f"{backoff_s:.2f} s", logging.DEBUG if not was_up
                    else logging.WARNING if ever_connected else logging.INFO)
                was_up = False
            finally:
                self._mark_down()
                await channel.close(grace=None)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.pool.backoff_max_s)

    async def _serve(self, channel: grpc.aio.Channel):
        """Checks GetInfo, opens the Propose stream; yields once connected and after each response."""
        stub = specdec_pb2_grpc.DrafterStub(channel)
        info = await stub.GetInfo(specdec_pb2.GetDrafterInfoRequest(),
                                  timeout=_GET_INFO_TIMEOUT_S)
        refusal = self.pool.check_info(info)
        if refusal is not None:
            raise refusal
        self.max_num_speculative_tokens = info.max_num_speculative_tokens
        self.wants_finished_outputs = info.wants_finished_outputs
        self._outbox = asyncio.Queue()
        self._call = stub.Propose(_drain(self._outbox))
        self.health.up()
        self.generation += 1
        logger.info("drafter %s connected: method=%s max k=%d", self.address, info.method,
                    info.max_num_speculative_tokens)
        # Before any step's message can be queued (no await in between): a catch-up replay
        # goes first on the fresh stream.
        self.pool.replica_connected(self)
        yield
        async for response in self._call:
            self._on_response(response)
            yield

    def _on_response(self, response: specdec_pb2.ProposeResponse) -> None:
        self.health.alive()
        self._num_unanswered = max(0, self._num_unanswered - 1)
        future = self._pending.pop(response.step_id, None)
        if future is not None and not future.done():
            future.set_result(response)
            return
        for sequence_draft in response.drafts:  # late: only its resync requests still count
            if sequence_draft.needs_resync:
                self.pool.mark_needs_resync(self, sequence_draft.seq_id)

    def _mark_down(self) -> None:
        self.health.down()
        self.catching_up = False
        self._call = None
        self._num_unanswered = 0
        self._outbox.put_nowait(None)  # ends the request stream of a half-dead call
        for future in self._pending.values():
            if not future.done():
                future.set_result(None)
        self._pending.clear()
        self.pool.drop_replica_sequences(self)


async def _drain(outbox: asyncio.Queue[specdec_pb2.ProposeRequest | None]):
    """The request side of a Propose stream: messages as propose() queues them."""
    while (message := await outbox.get()) is not None:
        yield message


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__

