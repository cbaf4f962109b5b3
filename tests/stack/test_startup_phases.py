"""A starting verifier says what it is doing, and a gateway shows it (issue 43, item 2).

The verifier binds its gRPC port before it builds its engine: health NOT_SERVING,
GetInfo carrying only the start-up phase, Generate refused with UNAVAILABLE. A gateway's
probes turn that into `"starting: <phase>"`, and its /health into `"status": "starting"`,
instead of an unreachable verifier. The launched default stack goes through "starting"
to "ok" and logs no WARNING on the way.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.verifier_client import VerifierClient
from specdec.config_flags import build_config
from specdec.models.model_files import PHASE_CONVERTING
from specdec.startup_health import StartupHealth
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.served_stack import ENV, ROOT, free_port
from tests.support.stack_processes import MARK_ENV, new_mark, processes_marked
from tests.support.tiny_models import make_tiny_llama
from verifier_svc import server as verifier_server
from verifier_svc.builder import VerifierConfig, build_engine
from verifier_svc.startup_phase import PHASE_LOADING_WEIGHTS, PHASE_WAITING_FOR_DRAFTER
from verifier_svc.server import start_verifier

SERVICE = "specdec.v1.Verifier"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-startup"))


async def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.05)


async def test_a_starting_verifier_tells_its_phase_and_refuses_requests(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loading = threading.Event()
    release = threading.Event()

    def build_held_while_loading(config: VerifierConfig, enter_phase) -> object:
        def enter(name: str) -> None:
            enter_phase(name)
            if name == PHASE_LOADING_WEIGHTS:
                loading.set()
                assert release.wait(60)
        return build_engine(config, enter)

    monkeypatch.setattr(verifier_server, "build_engine", build_held_while_loading)
    port = free_port()
    config = build_config(VerifierConfig, model=str(tiny_model), device="cpu", dtype="float32",
                          max_model_len=128, num_kv_blocks=64)
    starting = asyncio.ensure_future(start_verifier(config, "127.0.0.1", port))
    client = VerifierClient([f"127.0.0.1:{port}"], reprobe_interval_s=0.05)
    try:
        assert await asyncio.to_thread(loading.wait, 60)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = specdec_pb2_grpc.VerifierStub(channel)
            info = await stub.GetInfo(specdec_pb2.GetVerifierInfoRequest(), timeout=10)
            assert info == specdec_pb2.VerifierInfo(startup_phase=PHASE_LOADING_WEIGHTS)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(specdec_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6], sampling=specdec_pb2.SamplingParams(max_tokens=2)),
                    timeout=10).read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert PHASE_LOADING_WEIGHTS in refused.value.details()

            await client.start()
            assert client.statuses() == {"verifier-0": f"starting: {PHASE_LOADING_WEIGHTS}"}
            assert client.starting and not client.serving

            release.set()
            verifier = await starting
            try:
                await until(lambda: asyncio.sleep(0, client.serving))
                assert client.statuses() == {"verifier-0": "serving"} and not client.starting
                info = await stub.GetInfo(specdec_pb2.GetVerifierInfoRequest(), timeout=10)
                assert info.startup_phase == "" and info.max_model_len == 128
                tokens = [t async for r in stub.Generate(specdec_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6], sampling=specdec_pb2.SamplingParams(
                        max_tokens=2, ignore_eos=True)), timeout=30) for t in r.token_ids]
                assert len(tokens) == 2
            finally:
                await verifier.stop()
    finally:
        release.set()
        await client.close()
        if not starting.done():
            starting.cancel()


def test_the_launchers_health_tells_its_phase_until_the_gateway_takes_over() -> None:
    port = free_port()
    health = StartupHealth("127.0.0.1", port)
    try:
        health.enter(PHASE_CONVERTING)
        response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert response.status_code == 503
        assert response.json() == {"status": "starting", "phase": PHASE_CONVERTING,
                                   "verifiers": {}, "problems": []}
    finally:
        health.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    StartupHealth("127.0.0.1", port).close()  # the address is free again


def test_the_launcher_hands_its_listening_socket_over() -> None:
    """Between the launcher's last answer and the gateway's first, a poll waits in the
    socket's backlog instead of finding the address closed."""
    port = free_port()
    health = StartupHealth("127.0.0.1", port)
    try:
        listen_fd = health.hand_over()
        assert listen_fd is not None
        # What the gateway inherits: a copy of the listening socket.
        inherited = socket.socket(fileno=os.dup(listen_fd))
    finally:
        health.close()
    with inherited, socket.create_connection(("127.0.0.1", port), timeout=5) as early:
        early.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        accepted, _ = inherited.accept()  # the gateway starts serving
        with accepted:
            assert accepted.recv(1024).startswith(b"GET /health")


def _health(port: int, refusals: list[float] | None = None) -> dict | None:
    """The body of /health; None when there is none yet. A refused connection is recorded
    in `refusals`."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
    except httpx.ConnectError:
        if refusals is not None:
            refusals.append(time.monotonic())
        return None
    except (httpx.HTTPError, json.JSONDecodeError):
        return None


def _drafter_pid(mark: str) -> int | None:
    return next((pid for pid, command in processes_marked(mark) if "drafter_svc" in command), None)


@pytest.mark.timeout(900)
def test_the_default_stack_goes_through_starting_to_ok_without_a_warning(tmp_path: Path) -> None:
    port, mark = free_port(), new_mark()
    log = tmp_path / "serve.log"
    # The README's command (`make serve`) on a free port.
    command = [sys.executable, "-m", "specdec", "serve", "--port", str(port),
               "--speculative-config", '{"num_speculative_tokens":1,"method":"ngram",'
               '"prompt_lookup_min":1,"prompt_lookup_max":8}']
    with log.open("wb") as out:
        launcher = subprocess.Popen(command, cwd=ROOT, env={**ENV, MARK_ENV: mark},
                                    stdout=out, stderr=subprocess.STDOUT)
    seen: list[dict] = []
    refusals: list[float] = []  # connections refused once /health had answered
    try:
        # Holding the drafter (SIGSTOP as soon as it exists) keeps the verifier in its last
        # phase, waiting for it, however fast the rest starts here.
        deadline = time.monotonic() + 600
        while (drafter := _drafter_pid(mark)) is None:
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(drafter, signal.SIGSTOP)
        try:
            while not (seen and seen[-1]["status"] == "starting"
                       and seen[-1]["verifiers"].get("verifier-0")
                       == f"starting: {PHASE_WAITING_FOR_DRAFTER}"):
                assert launcher.poll() is None and time.monotonic() < deadline, seen[-3:]
                if (body := _health(port, refusals if seen else None)) is not None:
                    seen.append(body)
                time.sleep(0.1)
        finally:
            os.kill(drafter, signal.SIGCONT)
        while not (seen and seen[-1]["status"] == "ok"):
            assert launcher.poll() is None and time.monotonic() < deadline, seen[-3:]
            if (body := _health(port, refusals if seen else None)) is not None:
                seen.append(body)
            time.sleep(0.1)
        while "specdec ready in" not in log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    # The launcher's own answers (a phase, no verifier yet), then the gateway's.
    statuses = [body["verifiers"].get("verifier-0", "") for body in seen if "phase" not in body]
    assert all(s == "serving" or s.startswith("starting: ") for s in statuses), statuses
    assert all(body["status"] == "starting" for body in seen if "phase" in body)
    assert all(body["problems"] == [] for body in seen)
    # The gateway took the launcher's socket over: the address never closed in between.
    assert not refusals, f"{len(refusals)} polls refused after the first answer"
    start_log = log.read_text().split("specdec ready in")[0]
    assert not re.findall(r".*\bWARNING\b.*", start_log), re.findall(r".*\bWARNING\b.*", start_log)
