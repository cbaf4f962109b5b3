"""What every specdec gRPC server shares: message limits, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.grpc_malformed import MalformedRequestInterceptor

logger = logging.getLogger(__name__)

# Explicit on both ends: hidden states for a long prompt can be tens of MB.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
SHUTDOWN_GRACE_S = 5.0


class GrpcServer:
    """A grpc.aio server with the standard health service and reflection."""

    def __init__(self, service_names: list[str]) -> None:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS,
                                      interceptors=[MalformedRequestInterceptor()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection(
            [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = 0

    async def start(self, host: str, port: int,
                    credentials: grpc.ServerCredentials | None = None) -> int:
        """Binds host:port (TLS only when credentials are given) and reports SERVING."""
        address = f"{host}:{port}"
        self.port = (self.server.add_secure_port(address, credentials) if credentials is not None
                     else self.server.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        await self.server.start()
        await self.set_serving(True)
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
