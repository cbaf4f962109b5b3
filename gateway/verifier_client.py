"""grpc.aio client for one or more verifiers.

Round-robin over healthy verifiers. A verifier is healthy once `GetInfo` answered
(at start-up and after every reconnect); a Generate call that fails with UNAVAILABLE
before its first response marks it down and the request moves on to the next one.
Verifiers that are down are re-probed in the background, at most every
`reprobe_interval_s`, and all of them at once when none is healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import error_from_grpc
from specdec.errors import UnavailableError
from specdec.tls import GrpcTlsConfig, open_channel
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

logger = logging.getLogger(__name__)

_VERIFIER_SERVICE = specdec_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted verifier is found within a second, not after grpc's 120 s max backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(slots=True)
class _Endpoint:
    address: str
    channel: grpc.aio.Channel
    stub: specdec_pb2_grpc.VerifierStub
    info: specdec_pb2.VerifierInfo | None = None
    healthy: bool = False
    last_probe_at: float = 0.0
    # What /health reports: serving | not_serving (draining, shutting down) |
    # unreachable (down, or still loading its model).
    status: str = "unreachable"


class GenerationStream:
    """One running Generate call. Iterate for responses; `cancel()` aborts the sequence."""

    def __init__(self, call: grpc.aio.UnaryStreamCall,
                 first_response: specdec_pb2.GenerateResponse, address: str) -> None:
        self._call = call
        self._first_response = first_response
        self.address = address

    def __aiter__(self) -> AsyncIterator[specdec_pb2.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[specdec_pb2.GenerateResponse]:
        yield self._first_response
        while True:
            try:
                response = await self._call.read()
            except grpc.aio.AioRpcError as err:
                raise error_from_grpc(err) from None
            if response is grpc.aio.EOF:
                return
            yield response

    def cancel(self) -> None:
        """Cancels the call; the verifier frees the sequence. A no-op once finished."""
        self._call.cancel()


class VerifierClient:
    """Clients of the verifiers at `addresses` ("host:port"). Start in the serving loop."""

    def __init__(self, addresses: Sequence[str], *, probe_timeout_s: float = 2.0,
                 reprobe_interval_s: float = 2.0, tls: GrpcTlsConfig | None = None) -> None:
        if not addresses:
            raise ValueError("at least one verifier address is needed")
        self.addresses = tuple(addresses)
        self._probe_timeout_s = probe_timeout_s
        self._reprobe_interval_s = reprobe_interval_s
        self._tls = tls  # None or no --grpc-tls-ca: plain channels
        self._endpoints: list[_Endpoint] = []
        self._next_index = 0
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._endpoints = []
        for address in self.addresses:
            channel = open_channel(self._tls, address, _CHANNEL_OPTIONS)
            self._endpoints.append(_Endpoint(address, channel,
                                             specdec_pb2_grpc.VerifierStub(channel)))
        await self.probe_all()
        if not any(e.healthy for e in self._endpoints):
            logger.warning("no verifier reachable at %s; requests get 503 until one is",
                           ", ".join(self.addresses))

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for endpoint in self._endpoints:
            await endpoint.channel.close()

    async def _probe(self, endpoint: _Endpoint) -> bool:
        endpoint.last_probe_at = time.monotonic()
        try:
            health = await health_pb2_grpc.HealthStub(endpoint.channel).Check(
                health_pb2.HealthCheckRequest(service=_VERIFIER_SERVICE),
                timeout=self._probe_timeout_s)
            serving = health.status == health_pb2.HealthCheckResponse.SERVING
            info = await endpoint.stub.GetInfo(specdec_pb2.GetVerifierInfoRequest(),
                                               timeout=self._probe_timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                if endpoint.healthy:
                    logger.warning("verifier %s is down: %s", endpoint.address, err.code().name)
                endpoint.healthy = False
                endpoint.status = "unreachable"
                return False
            # A verifier without the health service: GetInfo alone decides.
            return await self._probe_info_only(endpoint)
        if not serving:
            if endpoint.healthy:
                logger.warning("verifier %s is not serving (shutting down)", endpoint.address)
            endpoint.healthy = False
            endpoint.status = "not_serving"
            return False
        return self._mark_up(endpoint, info)

    async def _probe_info_only(self, endpoint: _Endpoint) -> bool:
        try:
            info = await endpoint.stub.GetInfo(specdec_pb2.GetVerifierInfoRequest(),
                                               timeout=self._probe_timeout_s)
        except grpc.aio.AioRpcError as err:
            if endpoint.healthy:
                logger.warning("verifier %s is down: %s", endpoint.address, err.code().name)
            endpoint.healthy = False
            endpoint.status = "unreachable"
            return False
        return self._mark_up(endpoint, info)

    def _mark_up(self, endpoint: _Endpoint, info: specdec_pb2.VerifierInfo) -> bool:
        if not endpoint.healthy:
            logger.info("verifier %s is up: model %s, max_model_len %d, speculation %s k=%d",
                        endpoint.address, info.model_path, info.max_model_len,
                        info.speculative_method or "off", info.num_speculative_tokens)
        endpoint.info = info
        endpoint.healthy = True
        endpoint.status = "serving"
        return True

    def _mark_down(self, endpoint: _Endpoint, err: grpc.aio.AioRpcError) -> None:
        if endpoint.healthy:
            logger.warning("verifier %s is down: %s", endpoint.address, err.code().name)
        endpoint.healthy = False
        endpoint.status = "unreachable"
        endpoint.last_probe_at = time.monotonic()

    async def probe_all(self) -> bool:
        """Probes every verifier now; True when at least one answered."""
        results = await asyncio.gather(*(self._probe(e) for e in self._endpoints))
        return any(results)

    def statuses(self) -> dict[str, str]:
        """Each verifier's address and its last known status."""
        return {endpoint.address: endpoint.status for endpoint in self._endpoints}

    def _reprobe_in_background(self) -> None:
        now = time.monotonic()
        for endpoint in self._endpoints:
            if not endpoint.healthy and now - endpoint.last_probe_at >= self._reprobe_interval_s:
                endpoint.last_probe_at = now
                task = asyncio.create_task(self._probe(endpoint))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    @property
    def cached_info(self) -> specdec_pb2.VerifierInfo | None:
        for endpoint in self._endpoints:
            if endpoint.healthy and endpoint.info is not None:
                return endpoint.info
        return next((e.info for e in self._endpoints if e.info is not None), None)

    async def get_info(self) -> specdec_pb2.VerifierInfo:
        """The served model's facts; probes when no verifier has answered yet."""
        info = self.cached_info
        if info is None and await self.probe_all():
            info = self.cached_info
        if info is None:
            raise UnavailableError(
                f"No verifier is reachable (tried {', '.join(self.addresses)}).")
        return info

    def _round_robin(self) -> list[_Endpoint]:
        start = self._next_index % len(self._endpoints)
        self._next_index = start + 1
        return self._endpoints[start:] + self._endpoints[:start]

    async def generate(self, request: specdec_pb2.GenerateRequest) -> GenerationStream:
        """Starts Generate on a healthy verifier and waits for its first response.

        Raises the mapped domain error (UnavailableError when none is reachable).
        """
        self._reprobe_in_background()
        ordered = self._round_robin()
        if not any(e.healthy for e in ordered):
            await self.probe_all()
        for endpoint in (e for e in ordered if e.healthy):
            call = endpoint.stub.Generate(request)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    self._mark_down(endpoint, err)
                    continue
                raise error_from_grpc(err) from None
            except BaseException:
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                raise UnavailableError("The verifier ended the stream before any token.")
            return GenerationStream(call, first, endpoint.address)
        raise UnavailableError(f"No verifier is reachable (tried {', '.join(self.addresses)}).")
