"""Stopping a drafter ends its open Propose streams with UNAVAILABLE before the grace
period, so grpc never cancels a stream handler (it logged "Exception not handled ...
CancelledError" at every roll) and the verifier's side of the stream sees why it ended."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from drafter_svc.server import (
    SHUTDOWN_DETAILS,
    start_drafter_server,
    stop_drafter_server,
)
from specdec.config import SpeculativeConfig
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.drafting.drafter_pool import DrafterPool

CONFIG = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})


async def open_stream(chan: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    """A Propose stream that has answered one step and is waiting for the next."""
    call = specdec_pb2_grpc.DrafterStub(chan).Propose()
    await call.write(specdec_pb2.ProposeRequest(step_id=1, sequences=[
        specdec_pb2.SequenceUpdate(seq_id=1, new_token_ids=[1, 2, 3, 1, 2], context_len=5,
                                   num_speculative_tokens=3)]))
    response = await call.read()
    assert response.step_id == 1
    return call


def test_stopping_with_an_open_stream_ends_it_unavailable_and_logs_no_error(caplog):
    caplog.set_level(logging.INFO)
    seen: list[tuple[grpc.StatusCode, str]] = []

    async def serve_and_stop() -> None:
        server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            calls = [await open_stream(chan) for _ in range(2)]
            await stop_drafter_server(server, grace_s=1.0)
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call.read()
                seen.append((error.value.code(), error.value.details()))
        assert server.servicer is not None and not server.servicer._streams

    # The loop ends right after the stop, as the drafter process's does: a stream handler
    # grpc was still cancelling is reported then ("Exception not handled").
    asyncio.run(serve_and_stop())
    assert seen == [(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_DETAILS)] * 2
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], [record.getMessage() for record in errors]


async def test_a_stream_opened_while_stopping_is_refused():
    server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0)
    try:
        assert server.servicer is not None
        await server.servicer.end_streams()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await open_stream(chan)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error.value.details() == SHUTDOWN_DETAILS
    finally:
        await stop_drafter_server(server, grace_s=0)


def test_the_verifiers_drafter_pool_sees_the_stream_end_unavailable(caplog):
    """The verifier's side: its replica's stream breaks with the drafter's UNAVAILABLE
    (a WARNING, it reconnects elsewhere or later), and neither side logs an ERROR."""
    caplog.set_level(logging.INFO)

    async def serve_and_stop() -> None:
        server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0)
        pool = DrafterPool([f"127.0.0.1:{port}"], vocab_size=100, tokenizer_fingerprint="",
                           backoff_initial_s=0.05, backoff_max_s=0.2)
        await pool.start()
        try:
            assert await pool.wait_for_healthy(1, timeout_s=20)
            await stop_drafter_server(server, grace_s=1.0)
            deadline = time.monotonic() + 20
            while pool.num_healthy() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert pool.num_healthy() == 0
        finally:
            await pool.close()

    asyncio.run(serve_and_stop())
    messages = [record.getMessage() for record in caplog.records]
    assert any(f"UNAVAILABLE: {SHUTDOWN_DETAILS}" in message for message in messages), messages
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], [record.getMessage() for record in errors]
