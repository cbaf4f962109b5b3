"""Overload and timeouts on the Verifier gRPC service (issue 6, item 5).

Faults injected: more requests than `max_num_seqs + max_waiting_requests`; a client
whose gRPC deadline passes mid-generation; a request outliving `request_timeout_s`.
The model is slowed by a fixed sleep per forward so that "mid-generation" is certain.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from specdec.config import EngineConfig
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import ConfigError, OverloadedError
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.tiny_models import make_tiny_llama
from tests.support.verifier_harness import StartVerifier, request, verifier_starter
from verifier_svc.server import RunningVerifier

NUM_BLOCKS = 128
# Each forward's floor: it makes "mid-generation" certain. The deadlines below are long
# enough for a few steps on a loaded machine and far shorter than 100 steps' floor (5 s).
STEP_S = 0.05


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-overload"))


@pytest.fixture
async def start(tiny_model: Path, device) -> AsyncIterator[StartVerifier]:
    """Starts verifiers with config overrides, each forward slowed by STEP_S."""
    async with verifier_starter(tiny_model, device, NUM_BLOCKS, STEP_S) as start_one:
        yield start_one


async def collect(call: grpc.aio.UnaryStreamCall) -> tuple[list[int], int]:
    """Token ids and the last finish reason of a whole stream."""
    tokens: list[int] = []
    finish = specdec_pb2.FINISH_REASON_UNSPECIFIED
    async for response in call:
        tokens.extend(response.token_ids)
        finish = response.finish_reason
    return tokens, finish


async def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """A hang guard: how long the condition takes depends on the machine."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


def all_blocks_free(verifier: RunningVerifier) -> bool:
    engine = verifier.engine
    return (engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
            and engine.num_requests == 0 and not engine.scheduler.has_work())


@pytest.mark.parametrize("overrides,limit", [
    ({"max_num_seqs": 8}, 32),                           # default: 4 x max_num_seqs
    ({"max_num_seqs": 8, "max_waiting_requests": 0}, 0),  # no queue, still bounded
    ({"max_num_seqs": 2, "max_waiting_requests": 5}, 5),
])
def test_the_waiting_queue_is_always_bounded(overrides: dict, limit: int) -> None:
    assert EngineConfig(max_model_len=64, num_kv_blocks=8, **overrides).waiting_limit == limit


@pytest.mark.parametrize("overrides,param", [
    ({"max_waiting_requests": -1}, "max_waiting_requests"),
    ({"request_timeout_s": 0.0}, "request_timeout_s"),
])
def test_bad_limits_are_refused(overrides: dict, param: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(max_model_len=64, num_kv_blocks=8, **overrides)
    assert info.value.param == param


async def test_engine_refuses_beyond_the_bound_and_accepts_again(start: StartVerifier) -> None:
    engine = (await start(max_num_seqs=2, max_waiting_requests=1)).engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    seq_ids = [engine.add_request(f"r{i}", [5, 6, 7], params)[0] for i in range(3)]
    with pytest.raises(OverloadedError) as info:
        engine.add_request("r3", [5, 6, 7], params)
    assert "max_waiting_requests 1" in info.value.message
    engine.abort(seq_ids[0])
    seq_ids.append(engine.add_request("r4", [5, 6, 7], params)[0])
    for seq_id in seq_ids:
        engine.abort(seq_id)


async def test_a_full_queue_answers_resource_exhausted_and_others_go_on(
        start: StartVerifier) -> None:
    verifier = await start(max_num_seqs=2, max_waiting_requests=2)
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)
        calls = [stub.Generate(request(prompt, 20)) for prompt in prompts]
        # Two running and two waiting: the queue is full.
        await wait_until(lambda: verifier.engine.num_requests == 4)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub.Generate(request([9, 9, 9], 5)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded" in info.value.details()
        assert "Traceback" not in info.value.details()
        outputs = await asyncio.gather(*(collect(call) for call in calls))
        # The four admitted requests were unaffected, and the queue takes requests again.
        alone = [await collect(stub.Generate(request(prompt, 20))) for prompt in prompts]
    assert list(outputs) == alone
    assert all(len(tokens) == 20 and finish == specdec_pb2.FINISH_REASON_LENGTH
               for tokens, finish in outputs)
    assert all_blocks_free(verifier)


async def test_client_deadline_aborts_mid_generation(start: StartVerifier) -> None:
    verifier = await start()
    engine = verifier.engine
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)
        # 100 tokens take over 5 s; the deadline is 2 s.
        call = stub.Generate(request(list(range(3, 30)), 100), timeout=2.0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                tokens.extend(response.token_ids)
        steps_at_deadline = engine.num_steps
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0 < len(tokens) < 100, "the deadline must fall mid-generation"
        await wait_until(lambda: all_blocks_free(verifier))
        # Aborted at once: at most the step already running finished after the deadline.
        assert engine.num_steps - steps_at_deadline <= 1
        # The engine serves the next request.
        next_tokens, finish = await collect(stub.Generate(request([5, 6], 4)))
    assert len(next_tokens) == 4 and finish == specdec_pb2.FINISH_REASON_LENGTH


async def test_server_request_timeout_ends_long_requests_only(start: StartVerifier) -> None:
    verifier = await start(request_timeout_s=2.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)
        # No client deadline: only the server's limit can end it.
        long_call = stub.Generate(request(list(range(3, 30)), 100))
        short_tokens, short_finish = await collect(stub.Generate(request([5, 6, 7], 5)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(long_call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "--request-timeout-s (2 s)" in info.value.details()
    assert (len(short_tokens), short_finish) == (5, specdec_pb2.FINISH_REASON_LENGTH)
    await wait_until(lambda: all_blocks_free(verifier))
