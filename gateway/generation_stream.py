"""One running Generate call of the gateway, on one verifier and, before its first token,
possibly another.

A call that fails before any token was read (unreachable, an internal error, overloaded,
the stream ending empty) moves once to another healthy verifier: the client has seen
nothing yet. After a token, a failure ends the stream with the mapped error.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc

from gateway.errors import UNAVAILABLE_MESSAGE, error_from_grpc
from specdec.errors import SpecdecError, UnavailableError
from specdec.v1 import specdec_pb2

if TYPE_CHECKING:
    from gateway.verifier_endpoint import VerifierEndpoint

logger = logging.getLogger(__name__)

# Failures another verifier may not have. Request errors (INVALID_ARGUMENT...) would fail
# the same way anywhere, so they are not retried.
RETRYABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
})
# Retries of one request before its first token: once, as the load it can add is bounded.
MAX_RETRIES = 1

class VerifierPicker(Protocol):
    """What a stream needs of its client (gateway.verifier_client.VerifierClient): the next
    verifier to try, and the evidence it saw of one's health."""

    def next_healthy(self, exclude: Sequence[VerifierEndpoint],
                     prefer: str | None = None) -> VerifierEndpoint | None: ...

    def alive(self, endpoint: VerifierEndpoint) -> None: ...

    def mark_down(self, endpoint: VerifierEndpoint, err: grpc.aio.AioRpcError) -> None: ...


class GenerationStream:
    """One running Generate call. Iterate for responses; `cancel()` aborts the sequence.

    Until a response carrying tokens was read, a retryable failure restarts the request
    on another healthy verifier (at most MAX_RETRIES times over the whole request)."""

    def __init__(self, client: VerifierPicker, request: specdec_pb2.GenerateRequest,
                 prefer: str | None = None) -> None:
        self._client = client
        self._request = request
        # The verifier to try first when healthy (a request's other choices go where its
        # first one went, whose prompt blocks that verifier has cached).
        self._prefer = prefer
        self._tried: list[VerifierEndpoint] = []
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._first_response: specdec_pb2.GenerateResponse | None = None
        self.address = ""

    async def open(self) -> None:
        """Starts the call and waits for its first response (raises the mapped error)."""
        self._first_response = await self._start(None)

    async def _start(self, error: SpecdecError | None) -> specdec_pb2.GenerateResponse:
        """The first response of the call on the next healthy verifier not tried yet."""
        while True:
            endpoint = (self._client.next_healthy(self._tried,
                                                   None if self._tried else self._prefer)
                        if len(self._tried) <= MAX_RETRIES else None)
            if endpoint is None:
                raise error or UnavailableError(UNAVAILABLE_MESSAGE)
            if self._tried:
                logger.warning("request %s: retrying on verifier %s", self._request.request_id,
                               endpoint.address)
            self._tried.append(endpoint)
            self.address = endpoint.address
            call = endpoint.stub.Generate(self._request)
            self._call = call
            try:
                first = await call.read()
                self._client.alive(endpoint)
            except grpc.aio.AioRpcError as err:
                error = self._failed_before_tokens(endpoint, err)
                continue
            except BaseException:
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                logger.warning("verifier %s ended request %s before any token",
                               endpoint.address, self._request.request_id)
                error = UnavailableError(UNAVAILABLE_MESSAGE)
                continue
            return first

    def _failed_before_tokens(self, endpoint: VerifierEndpoint,
                              err: grpc.aio.AioRpcError) -> SpecdecError:
        """The mapped error when another verifier may do better; else raises it."""
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            self._client.mark_down(endpoint, err)
        error = error_from_grpc(err)
        if err.code() not in RETRYABLE_CODES:
            raise error from None
        logger.warning("verifier %s failed request %s before its first token: %s: %s",
                       endpoint.address, self._request.request_id, err.code().name,
                       err.details())
        return error

    def __aiter__(self) -> AsyncIterator[specdec_pb2.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[specdec_pb2.GenerateResponse]:
        response = self._first_response
        assert response is not None and self._call is not None, "open() first"
        got_tokens = False
        while True:
            got_tokens = got_tokens or bool(response.token_ids)
            yield response
            endpoint = self._tried[-1]
            try:
                response = await self._call.read()
                self._client.alive(endpoint)
            except grpc.aio.AioRpcError as err:
                if not got_tokens:
                    response = await self._start(self._failed_before_tokens(endpoint, err))
                    continue
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    self._client.mark_down(endpoint, err)
                logger.warning("verifier %s failed request %s mid-stream: %s: %s",
                               endpoint.address, self._request.request_id, err.code().name,
                               err.details())
                raise error_from_grpc(err) from None
            if response is grpc.aio.EOF:
                return

    def cancel(self) -> None:
        """Cancels the call; the verifier frees the sequence. A no-op once finished."""
        if self._call is not None:
            self._call.cancel()
