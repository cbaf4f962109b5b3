"""Requests that end early on the Verifier gRPC service (issue 6, item 3, gRPC side).

Faults injected: a client cancelling its stream, closing its channel, or dying (SIGKILL,
so it never cancels); half of eight clients vanishing at random points; a client
vanishing while the drafter answers; a forward that raises once. Every time, every KV
block returns to the pool within one engine step, no sequence stays in the scheduler, and
the other requests keep their exact tokens.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.v1 import specdec_pb2_grpc
from tests.support.tiny_models import make_tiny_llama
from tests.support.verifier_harness import StartVerifier, request, slow_down, verifier_starter
from verifier_svc.server import RunningVerifier
from verifier_svc.speculation import probe_schedule

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 128
STEP_S = 0.02

# A client that starts a stream, says so after the first tokens, then waits to be killed.
CLIENT_SCRIPT = """
import asyncio, sys, grpc
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

async def main():
    channel = grpc.aio.insecure_channel(sys.argv[1])
    call = specdec_pb2_grpc.VerifierStub(channel).Generate(specdec_pb2.GenerateRequest(
        prompt_token_ids=list(range(3, 40)),
        sampling=specdec_pb2.SamplingParams(max_tokens=80, ignore_eos=True)))
    await call.read()
    print("streaming", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-disconnects"))


@pytest.fixture
async def start(tiny_model: Path, device) -> AsyncIterator[StartVerifier]:
    async with verifier_starter(tiny_model, device, NUM_BLOCKS) as start_one:
        yield start_one


async def collect(call: grpc.aio.UnaryStreamCall) -> list[int]:
    return [token for response in [r async for r in call] for token in response.token_ids]


def nothing_left(verifier: RunningVerifier) -> bool:
    engine = verifier.engine
    return (engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
            and engine.num_requests == 0
            and not engine.scheduler.running and not engine.scheduler.waiting)


async def wait_until_nothing_left(verifier: RunningVerifier, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not nothing_left(verifier):
        assert time.monotonic() < deadline, "KV blocks or sequences were left behind"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("how", ["cancel", "close_channel", "kill_client"])
async def test_a_vanished_client_frees_every_block_within_one_step(start: StartVerifier,
                                                                   how: str) -> None:
    verifier = await start()
    slow_down(verifier, STEP_S)
    engine = verifier.engine
    address = f"127.0.0.1:{verifier.port}"
    channel = grpc.aio.insecure_channel(address)
    client = None
    try:
        if how == "kill_client":
            client = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, address], cwd=ROOT,
                                      env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                      stdout=subprocess.PIPE, text=True)
            assert client.stdout is not None
            line = await asyncio.to_thread(client.stdout.readline)
            assert line.strip() == "streaming"
        else:
            call = specdec_pb2_grpc.VerifierStub(channel).Generate(
                request(list(range(3, 40)), 80))
            await call.read()
        assert engine.num_requests == 1
        assert engine.scheduler.block_manager.num_free_blocks < NUM_BLOCKS
        steps_before = engine.num_steps
        if how == "cancel":
            call.cancel()
        elif how == "close_channel":
            await channel.close()
        else:
            assert client is not None
            client.send_signal(signal.SIGKILL)
        await wait_until_nothing_left(verifier)
        assert engine.num_steps - steps_before <= 1
    finally:
        await channel.close()
        if client is not None:
            client.kill()
            client.wait()


async def test_engine_survives_half_of_many_clients_vanishing(start: StartVerifier) -> None:
    verifier = await start()
    address = f"127.0.0.1:{verifier.port}"
    prompts = [[5 + i, 6 + 2 * i, 7, 8 + i] for i in range(8)]
    max_tokens = 30
    rng = random.Random(1234)
    victims = set(rng.sample(range(8), 4))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)
        alone = [await collect(stub.Generate(request(p, max_tokens))) for p in prompts]

        async def survive(index: int) -> list[int]:
            return await collect(stub.Generate(request(prompts[index], max_tokens)))

        async def vanish(index: int) -> list[int]:
            # Each victim has its own channel: half cancel, half just close the channel.
            own = grpc.aio.insecure_channel(address)
            call = specdec_pb2_grpc.VerifierStub(own).Generate(request(prompts[index], max_tokens))
            tokens: list[int] = []
            for _ in range(rng.randint(1, max_tokens // 2)):
                tokens.extend((await call.read()).token_ids)
            if index % 2:
                call.cancel()
            await own.close()
            return tokens

        outputs = await asyncio.gather(*(vanish(i) if i in victims else survive(i)
                                         for i in range(8)))
        await wait_until_nothing_left(verifier)
        for index, tokens in enumerate(outputs):
            if index in victims:
                assert tokens == alone[index][:len(tokens)] and len(tokens) < max_tokens
            else:
                assert tokens == alone[index], f"request {index} changed"
        # And the engine goes on serving.
        assert await collect(stub.Generate(request(prompts[0], max_tokens))) == alone[0]


async def test_a_failing_forward_fails_only_its_step(start: StartVerifier) -> None:
    # One running sequence at a time: the second request waits while the first fails.
    verifier = await start(max_num_seqs=1)
    engine = verifier.engine
    execute = engine.runner.execute
    calls = 0

    def fail_third_forward(*args: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected fault: device-side assert\n" + "internal detail " * 200)
        return execute(*args)

    engine.runner.execute = fail_third_forward  # type: ignore[method-assign]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)
        first = stub.Generate(request([5, 6, 7], 20))
        await first.read()
        second = stub.Generate(request([8, 9, 10], 20))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await first.read() is not grpc.aio.EOF:
                pass
        second_tokens = await collect(second)
        await wait_until_nothing_left(verifier)
        # The engine serves normally afterwards: the waiting request was untouched.
        assert second_tokens == await collect(stub.Generate(request([8, 9, 10], 20)))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    details = info.value.details()
    assert "engine step" in details and len(details) < 200
    assert "Traceback" not in details and "internal detail" not in details
    assert len(second_tokens) == 20


async def test_a_client_vanishing_while_the_drafter_answers(start: StartVerifier,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Probes wait out their back-off only (no wait priced beyond it): the tiny model's step is
    # cheaper than a round trip, and the test needs steps that ask the drafter after
    # drafting stopped paying.
    monkeypatch.setattr(probe_schedule, "MAX_PROBE_INTERVAL", 1)  # no priced wait
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert spec is not None
    drafter, drafter_port = await start_drafter_server(spec, "127.0.0.1", 0)
    try:
        verifier = await start(speculative_config=spec,
                               drafter_targets=(f"127.0.0.1:{drafter_port}",),
                               draft_timeout_s=2.0)
        engine = verifier.engine
        pool = engine.drafter_pool
        assert pool is not None
        propose = pool.propose
        armed, proposing = asyncio.Event(), asyncio.Event()

        async def propose_until_an_abort(*args: object) -> object:
            # Holds one step in its proposal phase until a client of that step is gone.
            if armed.is_set() and not proposing.is_set():
                proposing.set()
                deadline = time.monotonic() + 30.0  # a hang guard
                while engine.num_requests == 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)
            return await propose(*args)

        pool.propose = propose_until_an_abort  # type: ignore[method-assign]
        prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [10, 11, 12, 10, 11, 12, 10, 11]]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
            stub = specdec_pb2_grpc.VerifierStub(channel)
            alone = await collect(stub.Generate(request(prompts[1], 40)))
            while pool.num_healthy() == 0:
                await asyncio.sleep(0.01)
            vanishing = stub.Generate(request(prompts[0], 40))
            staying = stub.Generate(request(prompts[1], 40))
            await vanishing.read()
            first = await staying.read()
            armed.set()
            await asyncio.wait_for(proposing.wait(), 30.0)  # a hang guard
            vanishing.cancel()
            rest: list[int] = []
            while (response := await staying.read()) is not grpc.aio.EOF:
                rest.extend(response.token_ids)
            await wait_until_nothing_left(verifier)
        assert list(first.token_ids) + rest == alone
        assert engine.spec.num_drafts > 0, "the drafter never proposed"
    finally:
        await stop_drafter_server(drafter, grace_s=0)
