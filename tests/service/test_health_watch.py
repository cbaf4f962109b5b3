"""grpc.health.v1.Health/Watch streams status changes on the verifier and the drafter, and
nothing an unauthenticated caller sends (garbage bytes, unknown services and methods,
half-finished streams) logs a traceback (issue 44, item 7). Real servers on port 0, both
requiring the internal token, called without it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.rpc.grpc_server import GrpcServer
from tests.support.tiny_models import make_tiny_llama
from tests.support.verifier_harness import verifier_starter

TOKEN = "the-internal-token-0123456789"
NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
GARBAGE = (b"\xff\xff\xff\x07garbage", b"\x0a\xff\xff", b"\x12" + b"\xff" * 10)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-health"))


@pytest.fixture(params=["verifier", "drafter"])
async def served(request: pytest.FixtureRequest, tiny_model: Path,
                 device) -> AsyncIterator[tuple[GrpcServer, int, str]]:
    """(server, port, its service name), requiring TOKEN."""
    if request.param == "drafter":
        server, port = await start_drafter_server(NGRAM, "127.0.0.1", 0, internal_token=TOKEN)
        yield server, port, "specdec.v1.Drafter"
        await stop_drafter_server(server, grace_s=0)
        return
    async with verifier_starter(tiny_model, device, num_blocks=32) as start:
        verifier = await start(internal_token=TOKEN)
        yield verifier.server, verifier.port, "specdec.v1.Verifier"


async def test_watch_streams_status_changes(served) -> None:
    server, port, service = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=30)
                   for name in ("", service)]
        for watch in watches:
            assert (await watch.read()).status == SERVING
        await server.set_serving(False)
        for watch in watches:
            assert (await watch.read()).status == NOT_SERVING
        await server.set_serving(True)
        for watch in watches:
            assert (await watch.read()).status == SERVING
            watch.cancel()
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
        assert (await unknown.read()).status == SERVICE_UNKNOWN
        unknown.cancel()
        assert (await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                 timeout=5)).status == SERVING


async def _expect_error(call: object) -> grpc.StatusCode:
    try:
        if hasattr(call, "read"):
            while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_nothing_an_unauthenticated_caller_sends_logs_a_traceback(
        served, caplog: pytest.LogCaptureFixture) -> None:
    _, port, service = served
    caplog.set_level(logging.DEBUG)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        codes = []
        for payload in GARBAGE:
            for method in ("Check", "Watch"):
                path = f"/grpc.health.v1.Health/{method}"
                callable_ = (channel.unary_unary(path) if method == "Check"
                             else channel.unary_stream(path))
                codes.append(await _expect_error(callable_(payload, timeout=5)))
            for path in (f"/{service}/GetInfo", "/specdec.v1.Nope/Nope",
                         "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
                codes.append(await _expect_error(channel.unary_unary(path)(payload, timeout=5)))
            bidi = channel.stream_stream(f"/{service}/Propose")()
            await bidi.write(payload)
            codes.append(await _expect_error(bidi))
        assert grpc.StatusCode.UNKNOWN not in codes
        assert grpc.StatusCode.INVALID_ARGUMENT in codes
        # Watches left open and cut by the client's going away.
        stub = health_pb2_grpc.HealthStub(channel)
        open_watches = [stub.Watch(health_pb2.HealthCheckRequest(service=name))
                        for name in ("", service, "x" * 1000)]
        for watch in open_watches:
            await watch.read()
    await asyncio.sleep(0.2)  # the server sees the cancellations
    tracebacks = [record for record in caplog.records
                  if record.exc_info or "Traceback" in record.getMessage()]
    assert not tracebacks, [record.getMessage()[:300] for record in tracebacks]
