"""Graceful shutdown of the verifier (issue 6, item 9).

Fault injected: SIGTERM to a real `python -m verifier_svc` while a request streams; and,
in-process with a slowed model, a request that outlives the grace period. Health turns
NOT_SERVING at once, new Generate calls get UNAVAILABLE, in-flight requests finish, the
ones still running when the grace is over end with UNAVAILABLE (never hang), and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.config_flags import build_config
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig
from verifier_svc.server import start_verifier

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "specdec.v1.Verifier"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
MAX_MODEL_LEN = 2048
NUM_BLOCKS = 512
STARTUP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-shutdown"),
                           max_positions=MAX_MODEL_LEN)


def request(prompt: list[int], max_tokens: int) -> specdec_pb2.GenerateRequest:
    return specdec_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=prompt,
        sampling=specdec_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def health_status(channel: grpc.aio.Channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=SERVICE), timeout=10.0)  # a hang guard
    return response.status


async def wait_for_health(channel: grpc.aio.Channel, status: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await health_status(channel) == status:
                return
        except grpc.aio.AioRpcError:
            pass  # not listening yet
        assert time.monotonic() < deadline, f"health never became {status}"
        await asyncio.sleep(0.05)


async def read_stream(call: grpc.aio.UnaryStreamCall) -> tuple[list[int], int, float]:
    """Tokens, the last finish reason, and when the last message arrived."""
    tokens: list[int] = []
    finish, last_at = specdec_pb2.FINISH_REASON_UNSPECIFIED, 0.0
    while (response := await call.read()) is not grpc.aio.EOF:
        tokens.extend(response.token_ids)
        finish, last_at = response.finish_reason, time.monotonic()
    return tokens, finish, last_at


async def assert_refused(stub: specdec_pb2_grpc.VerifierStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in stub.Generate(request([5, 6, 7], 4))]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in info.value.details()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_model: Path,
                                                           tmp_path: Path) -> None:
    # Far more than the request needs on any machine (it must finish within the grace); a
    # process that sat out the grace instead of exiting once drained would take all of it.
    grace_s = 60.0
    port = free_port()
    log_path = tmp_path / "verifier.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "verifier_svc", "--model", str(tiny_model), "--device", "cpu",
             "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
             "--num-gpu-blocks-override",
             str(NUM_BLOCKS), "--port", str(port), "--shutdown-grace-s", str(grace_s)],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=log)
    try:
        # Retry the connection every 100 ms while the server starts, not after 1 s.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 100)]) as channel:
            stub = specdec_pb2_grpc.VerifierStub(channel)
            await wait_for_health(channel, SERVING, STARTUP_TIMEOUT_S)
            # 1000 tokens take over a second on the tiny model.
            call = stub.Generate(request([5, 6, 7], 1000))
            first = await call.read()
            in_flight = asyncio.create_task(read_stream(call))
            signalled_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await wait_for_health(channel, NOT_SERVING, timeout_s=30.0)  # a hang guard
            await assert_refused(stub)
            tokens, finish, last_at = await asyncio.wait_for(in_flight, grace_s)
        returncode = await asyncio.to_thread(proc.wait, grace_s)
        exited_at = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    assert returncode == 0, log_text
    assert len(first.token_ids) + len(tokens) == 1000
    assert finish == specdec_pb2.FINISH_REASON_LENGTH
    assert last_at > signalled_at, "the request must still have been running at SIGTERM"
    assert exited_at - signalled_at < grace_s
    assert "Traceback" not in log_text


async def test_requests_outliving_the_grace_end_with_unavailable(tiny_model: Path,
                                                                device) -> None:
    # The short request's 10 steps fit in the grace however slow the machine (up to ~0.45 s
    # of compute a step), the long one's 200 never do (at least 10 s of sleeps).
    grace_s = 5.0
    verifier = await start_verifier(build_config(VerifierConfig,
        model=str(tiny_model), device=str(device), dtype="float32", max_model_len=256,
        block_size=4, num_kv_blocks=NUM_BLOCKS), "127.0.0.1", 0)
    engine = verifier.engine
    execute = engine.runner.execute

    def slow_execute(*args: object) -> object:
        time.sleep(0.05)  # 50 ms a step: 200 tokens take over 10 s, 10 tokens 0.5 s
        return execute(*args)

    engine.runner.execute = slow_execute  # type: ignore[method-assign]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
            stub = specdec_pb2_grpc.VerifierStub(channel)
            short_call = stub.Generate(request([5, 6, 7], 10))
            long_call = stub.Generate(request([8, 9, 10], 200))
            short_task = asyncio.create_task(read_stream(short_call))
            long_task = asyncio.create_task(read_stream(long_call))
            while engine.num_requests < 2 or engine.num_steps < 2:
                await asyncio.sleep(0.001)
            started_at = time.monotonic()
            shutdown = asyncio.create_task(verifier.shutdown(grace_s))
            await asyncio.sleep(0)
            assert await health_status(channel) == NOT_SERVING
            await assert_refused(stub)
            short_tokens, short_finish, _ = await short_task
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await long_task
            await asyncio.wait_for(shutdown, timeout=grace_s + 30.0)  # a hang guard
            stopped_at = time.monotonic()
    finally:
        await verifier.stop()
    assert (len(short_tokens), short_finish) == (10, specdec_pb2.FINISH_REASON_LENGTH)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down" in info.value.details()
    assert stopped_at - started_at >= grace_s  # it waited the grace (load only lengthens it)
    assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    assert not engine.scheduler.has_work()


def test_launcher_passes_the_flags_through_and_waits_out_the_grace() -> None:
    import argparse

    from specdec.launcher import _child_commands, add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--shutdown-grace-s", "30", "--max-waiting-requests", "7",
                              "--request-timeout-s", "12.5"])
    verifier = dict(_child_commands(args, "/models/tiny"))["verifier"]
    flags = dict(zip(verifier, verifier[1:]))
    assert (flags["--shutdown-grace-s"], flags["--max-waiting-requests"],
            flags["--request-timeout-s"]) == ("30.0", "7", "12.5")
    # Defaults: the verifier's own (4 x max-num-seqs waiting, no timeout, 10 s grace).
    defaults = dict(_child_commands(parser.parse_args([]), "/models/tiny"))["verifier"]
    assert "--max-waiting-requests" not in defaults and "--request-timeout-s" not in defaults


async def test_a_stop_that_outlives_its_bound_ends_the_process_with_every_stack(
        tiny_model: Path, tmp_path: Path) -> None:
    """Fault injected: the verifier's shutdown never returns. The watchdog ends the process
    (exit 1) with every thread's stack in its log, before the launcher would SIGKILL it."""
    port = free_port()
    log_path = tmp_path / "verifier.log"
    script = ("import asyncio, sys; from verifier_svc import server, __main__ as verifier;"
              "server.RunningVerifier.shutdown = lambda self, grace_s: asyncio.sleep(3600);"
              "sys.exit(verifier.main(sys.argv[1:]))")
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, "--model", str(tiny_model), "--device", "cpu",
             "--dtype", "float32", "--enforce-eager", "--num-gpu-blocks-override", str(NUM_BLOCKS),
             "--port", str(port), "--shutdown-grace-s", "0.5"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=log)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 100)]) as channel:
            await wait_for_health(channel, SERVING, STARTUP_TIMEOUT_S)
        proc.send_signal(signal.SIGTERM)
        # Far beyond the bound (0.5 + 1 + 2 s) on any machine: a hang guard, not a timing.
        returncode = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    assert returncode == 1, log_text
    assert "Timeout (0:00:03.500000)!" in log_text  # faulthandler's dump, with each thread's stack
    assert "Thread 0x" in log_text and "verifier_svc/__main__.py" in log_text
