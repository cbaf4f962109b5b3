"""The Verifier gRPC service on a real port: streaming, cancellation, errors, health."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.config_flags import build_config
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig
from verifier_svc.server import RunningVerifier, start_verifier

NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-svc"))


@pytest.fixture
async def verifier(tiny_model: Path, device) -> RunningVerifier:
    config = build_config(VerifierConfig, model=str(tiny_model), device=str(device), dtype="float32",
                          max_model_len=128, block_size=4, num_kv_blocks=NUM_BLOCKS)
    running = await start_verifier(config, "127.0.0.1", 0)
    yield running
    await running.stop()


def request(prompt: list[int], max_tokens: int, **sampling: object) -> specdec_pb2.GenerateRequest:
    return specdec_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=prompt,
        sampling=specdec_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))


async def test_generate_streams_until_length(verifier: RunningVerifier) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)
        responses = [r async for r in stub.Generate(request([5, 6, 7, 8], 10))]
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) == 10 and len(responses) == 10
    assert [r.finish_reason for r in responses[:-1]] == [specdec_pb2.FINISH_REASON_UNSPECIFIED] * 9
    last = responses[-1]
    assert last.finish_reason == specdec_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 10)


async def test_cancel_frees_blocks_within_a_step(verifier: RunningVerifier) -> None:
    block_manager = verifier.engine.scheduler.block_manager
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)
        call = stub.Generate(request(list(range(3, 40)), 80))
        await call.read()
        assert block_manager.num_free_blocks < NUM_BLOCKS
        call.cancel()
        for _ in range(100):
            if block_manager.num_free_blocks == NUM_BLOCKS:
                break
            await asyncio.sleep(0.01)
    assert block_manager.num_free_blocks == NUM_BLOCKS
    assert not verifier.engine.scheduler.has_work()


@pytest.mark.parametrize("message,detail", [
    (request([], 4), "prompt"),
    (request([5, 999_999], 4), "prompt"),
    (request([5, 6], 4, temperature=-1.0), "temperature"),
    (request([5, 6], 4, top_p=1.5), "top_p"),
    (request([5, 6], 4, repetition_penalty=-2.0), "repetition_penalty"),
    (request([5, 6], 127), "max_tokens"),
])
async def test_invalid_argument(verifier: RunningVerifier, message, detail: str) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in stub.Generate(message)]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert detail in info.value.details()
        # The server keeps serving.
        ok = [r async for r in stub.Generate(request([5, 6], 2))]
        assert ok[-1].finish_reason == specdec_pb2.FINISH_REASON_LENGTH


async def test_get_info_and_health(verifier: RunningVerifier) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        info = await specdec_pb2_grpc.VerifierStub(channel).GetInfo(
            specdec_pb2.GetVerifierInfoRequest())
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="specdec.v1.Verifier"))
    assert (info.max_model_len, info.vocab_size) == (128, 96)
    assert 2 in info.eos_token_ids and info.tokenizer_fingerprint
    assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_concurrent_streams(verifier: RunningVerifier) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)

        async def run(prompt: list[int]) -> list[int]:
            return [t async for r in stub.Generate(request(prompt, 12)) for t in r.token_ids]

        together = await asyncio.gather(*(run([5 + i, 6, 7]) for i in range(6)))
        alone = [await run([5 + i, 6, 7]) for i in range(6)]
    assert list(together) == alone


async def test_metrics_endpoint(tiny_model: Path, device) -> None:
    import httpx

    config = build_config(VerifierConfig, model=str(tiny_model), device=str(device), dtype="float32",
                          max_model_len=128, block_size=4, num_kv_blocks=NUM_BLOCKS)
    running = await start_verifier(config, "127.0.0.1", 0, metrics_port=0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = specdec_pb2_grpc.VerifierStub(channel)
            [r async for r in stub.Generate(request([5, 6, 7, 8], 6))]
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{running.engine.metrics.port}/metrics")).text
    finally:
        await running.stop()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["specdec:kv_cache_free_blocks"] == values["specdec:kv_cache_blocks"] == NUM_BLOCKS
    assert values["vllm:kv_cache_usage_perc"] == 0.0
    assert values["vllm:num_requests_running"] == 0.0
    assert values["vllm:e2e_request_latency_seconds_count"] == 1.0
    assert values["vllm:time_to_first_token_seconds_count"] == 1.0
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:num_preemptions_total"):
        assert name in values
