"""What every specdec gRPC server shares: message limits, keepalive, the internal token,
health, reflection (off unless asked for), shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.rpc.grpc_malformed import MalformedRequestInterceptor
from specdec.rpc.internal_auth import InternalTokenInterceptor

logger = logging.getLogger(__name__)

# Explicit on both ends: hidden states for a long prompt can be tens of MB. The one limit of
# every gRPC server and channel (the gateway's to the verifiers, the verifier's to the
# drafters).
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
SHUTDOWN_GRACE_S = 5.0

# Keepalive, one setting for both ends: clients (the verifier's drafter channels) ping an
# idle connection this often to notice a vanished peer, and servers accept pings that
# often. A server on gRPC's defaults allows one ping per 5 minutes without data and
# answers the third early one with GOAWAY "too_many_pings", which dropped the verifier's
# Propose streams after idle periods.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def client_keepalive_options(time_ms: int = KEEPALIVE_TIME_MS,
                             timeout_ms: int = KEEPALIVE_TIMEOUT_MS) -> list[tuple[str, int]]:
    """Channel options of a client that pings every `time_ms` (see server_keepalive_options)."""
    return [("grpc.keepalive_time_ms", time_ms),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            # By default a client stops pinging after 2 pings without data (then once a
            # minute), so a peer that vanished under an idle stream went unnoticed.
            ("grpc.http2.max_pings_without_data", 0)]


def server_keepalive_options(client_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, int]]:
    """Server options that accept the pings of client_keepalive_options(client_time_ms)."""
    return [# Half the client's interval: timer jitter never makes a ping count as early.
            ("grpc.http2.min_ping_interval_without_data_ms", client_time_ms // 2),
            # Pings on a connection with no call (between streams) are no strike either.
            ("grpc.keepalive_permit_without_calls", 1),
            # gRPC's default, explicit: a client pinging faster than that is still cut off.
            ("grpc.http2.max_ping_strikes", 2)]


class GrpcServer:
    """A grpc.aio server with the standard health service, and reflection when asked.

    With `internal_token`, every call but the health check must carry it (see
    specdec.rpc.internal_auth); None serves open (loopback, tests). `keepalive_time_ms` is
    the client ping interval to accept (tests scale it down).
    """

    def __init__(self, service_names: list[str], *, internal_token: str | None = None,
                 enable_reflection: bool = False,
                 keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> None:
        # The token check runs first: an unauthenticated request is never parsed.
        interceptors: list[grpc.aio.ServerInterceptor] = (
            [InternalTokenInterceptor(internal_token)] if internal_token is not None else [])
        interceptors.append(MalformedRequestInterceptor())
        self.server = grpc.aio.server(
            options=[*CHANNEL_OPTIONS, *server_keepalive_options(keepalive_time_ms)],
            interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        if enable_reflection:
            reflection.enable_server_reflection(
                [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME], self.server)
        self.port = 0

    async def start(self, host: str, port: int,
                    credentials: grpc.ServerCredentials | None = None, serving: bool = True) -> int:
        """Binds host:port (TLS only when credentials are given) and reports SERVING, or
        NOT_SERVING until `set_serving(True)` (a server that answers while it starts)."""
        address = f"{host}:{port}"
        self.port = (self.server.add_secure_port(address, credentials) if credentials is not None
                     else self.server.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        await self.server.start()
        await self.set_serving(serving)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


async def wait_for_signal() -> None:
    """Returns at the first SIGTERM or SIGINT.

    The handlers stay installed, so a repeated signal cannot kill a process that is
    still draining its requests.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def run_until_signalled(server: GrpcServer, on_stop: Callable[[], Awaitable[None]] | None = None,
                              ) -> None:
    """Serves until SIGTERM or SIGINT, then reports NOT_SERVING and stops gracefully."""
    await wait_for_signal()
    logger.info("signal received: stopping (grace %.0f s)", SHUTDOWN_GRACE_S)
    await server.stop()
    if on_stop is not None:
        await on_stop()
