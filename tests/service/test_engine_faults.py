"""An engine step that raises anywhere fails the requests it concerns, never spins.

A fault is injected once (in the scheduler's plan, in the speculation policy); the
requests in flight end with `EngineError` (INTERNAL over gRPC, a 500 from the gateway),
no KV block stays taken, and the engine then serves a new request with the same greedy
tokens as before the fault.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from gateway.errors import error_from_grpc, error_payload
from specdec.errors import SpecdecError
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.engine_harness import PROMPTS, generate, greedy, ngram_engine
from tests.support.tiny_models import make_tiny_llama
from tests.support.verifier_harness import request, verifier_starter
from specdec.engine.engine import Engine
from verifier_svc.requests import EngineError, RequestOutput, collect_outputs

NUM_BLOCKS = 256  # ngram_engine's num_kv_blocks
# Only a guard against a hang (the old engine retried forever): never reached when it works.
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-faults"))


class RaiseOnce:
    """Wraps a callable: the first call after `arm()` runs it, then raises."""

    def __init__(self, real: Callable[..., object]) -> None:
        self.real = real
        self.armed = False
        self.num_raised = 0

    def arm(self) -> None:
        self.armed = True

    def __call__(self, *args: object, **kwargs: object) -> object:
        result = self.real(*args, **kwargs)  # its side effects happen (blocks taken) ...
        if self.armed:
            self.armed = False
            self.num_raised += 1
            raise RuntimeError("injected fault")  # ... and its result is lost
        return result


async def outcome(queue: asyncio.Queue[RequestOutput | SpecdecError]) -> list[int] | SpecdecError:
    try:
        tokens, _ = await asyncio.wait_for(collect_outputs(queue), HANG_GUARD_S)
    except SpecdecError as exc:
        return exc
    return tokens


async def fault_in_flight(engine: Engine, fault: RaiseOnce) -> list[list[int] | SpecdecError]:
    """One request decoding (its blocks taken), two waiting; the fault fires at the next
    step. Returns how each of the three ended."""
    _, running = engine.add_request("running", PROMPTS[0], greedy(max_tokens=200))
    first = await asyncio.wait_for(running.get(), HANG_GUARD_S)
    assert isinstance(first, RequestOutput) and first.finish_reason is None
    assert engine.scheduler.block_manager.num_free_blocks < NUM_BLOCKS
    queues = [running]
    queues += [engine.add_request(f"waiting-{i}", PROMPTS[i], greedy())[1] for i in (1, 2)]
    fault.arm()
    return list(await asyncio.gather(*(outcome(queue) for queue in queues)))


def assert_nothing_left(engine: Engine) -> None:
    assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    assert not engine.scheduler.has_work()
    assert engine.num_requests == 0


async def test_a_raising_scheduler_fails_every_request_in_flight(tiny_model: Path, device) -> None:
    async with ngram_engine(tiny_model, str(device)) as engine:
        before = await generate(engine, PROMPTS[3], greedy())
        fault = RaiseOnce(engine.scheduler.schedule)
        engine.scheduler.schedule = fault  # type: ignore[method-assign]
        outcomes = await fault_in_flight(engine, fault)
        assert fault.num_raised == 1
        assert all(isinstance(result, EngineError) for result in outcomes), outcomes
        assert_nothing_left(engine)
        # The loop goes on: a new request gets what it got before the fault.
        after = await asyncio.wait_for(generate(engine, PROMPTS[3], greedy()), HANG_GUARD_S)
        assert after == before
        assert_nothing_left(engine)


async def test_a_raising_policy_fails_every_request_in_flight(tiny_model: Path, device) -> None:
    async with ngram_engine(tiny_model, str(device), k=3, adaptive_speculation=True) as engine:
        before = await generate(engine, PROMPTS[3], greedy())
        assert engine.speculation.policy is not None
        fault = RaiseOnce(engine.speculation.policy.plan)
        engine.speculation.policy.plan = fault  # type: ignore[method-assign]
        outcomes = await fault_in_flight(engine, fault)
        assert fault.num_raised == 1
        assert all(isinstance(result, EngineError) for result in outcomes), outcomes
        assert_nothing_left(engine)
        after = await asyncio.wait_for(generate(engine, PROMPTS[3], greedy()), HANG_GUARD_S)
        assert after == before
        assert_nothing_left(engine)


async def test_a_scheduler_that_always_raises_does_not_spin(tiny_model: Path, device) -> None:
    """Each request fails at once; with nothing left the loop waits instead of retrying."""
    async with ngram_engine(tiny_model, str(device)) as engine:
        calls = 0

        def broken(*args: object) -> object:
            nonlocal calls
            calls += 1
            raise RuntimeError("injected fault")

        engine.scheduler.schedule = broken  # type: ignore[method-assign]
        for attempt in range(2):
            _, queue = engine.add_request(f"r{attempt}", PROMPTS[0], greedy())
            assert isinstance(await outcome(queue), EngineError)
            calls_after_failure = calls
            for _ in range(500):  # many loop turns: a spinning engine would step in them
                await asyncio.sleep(0)
            assert calls == calls_after_failure == attempt + 1
            assert_nothing_left(engine)


async def test_a_raising_step_listener_fails_only_its_step(tiny_model: Path, device) -> None:
    """A fault after the plan knows the step's sequences fails those; the listener is the
    last thing a step runs."""
    async with ngram_engine(tiny_model, str(device)) as engine:
        fault = RaiseOnce(lambda record: None)
        engine.step_listener = fault
        outcomes = await fault_in_flight(engine, fault)
        assert fault.num_raised == 1
        assert isinstance(outcomes[0], EngineError)  # ran in the failed step
        assert_nothing_left(engine)


async def test_the_client_gets_internal_and_the_gateway_a_500(tiny_model: Path, device) -> None:
    async with verifier_starter(tiny_model, device, num_blocks=128) as start:
        verifier = await start()
        engine = verifier.engine
        fault = RaiseOnce(engine.scheduler.schedule)
        engine.scheduler.schedule = fault  # type: ignore[method-assign]
        fault.arm()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
            stub = specdec_pb2_grpc.VerifierStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(_tokens(stub, [5, 6, 7, 8]), HANG_GUARD_S)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "engine step" in info.value.details()
            assert "Traceback" not in info.value.details()
            status, body = error_payload(error_from_grpc(info.value))
            assert status == 500 and body["error"]["type"] == "server_error"
            assert len(await asyncio.wait_for(_tokens(stub, [5, 6, 7, 8]), HANG_GUARD_S)) == 6
        assert engine.scheduler.block_manager.num_free_blocks == 128


async def _tokens(stub: specdec_pb2_grpc.VerifierStub, prompt: list[int]) -> list[int]:
    responses = [r async for r in stub.Generate(request(prompt, 6))]
    assert responses[-1].finish_reason == specdec_pb2.FINISH_REASON_LENGTH
    return [t for r in responses for t in r.token_ids]
