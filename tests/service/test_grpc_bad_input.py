"""Bad bytes over gRPC get a proper status with a message; the servers go on serving."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig
from verifier_svc.server import start_verifier

GARBAGE = [b"\xff\xff\xff\x07garbage", b"\x12" + b"\xff" * 10, b"\x0a\x05ab"]
NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-bad-input"))


@pytest.fixture
async def verifier(tiny_model: Path, device):
    running = await start_verifier(build_config(VerifierConfig,
        model=str(tiny_model), device=str(device), dtype="float32", max_model_len=128,
        block_size=4, num_kv_blocks=64), "127.0.0.1", 0)
    yield running
    await running.stop()


async def generate_ok(channel: grpc.aio.Channel) -> None:
    stub = specdec_pb2_grpc.VerifierStub(channel)
    responses = [r async for r in stub.Generate(specdec_pb2.GenerateRequest(
        prompt_token_ids=[5, 6], sampling=specdec_pb2.SamplingParams(max_tokens=3)))]
    assert responses[-1].finish_reason == specdec_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("payload", GARBAGE)
async def test_malformed_generate_is_invalid_argument(verifier, payload: bytes) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        raw = channel.unary_stream("/specdec.v1.Verifier/Generate")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in raw(payload)]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request to /specdec.v1.Verifier/Generate" in info.value.details()
        await generate_ok(channel)


async def test_oversized_message_is_refused_not_fatal(verifier) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        raw = channel.unary_stream("/specdec.v1.Verifier/Generate")
        huge = specdec_pb2.GenerateRequest(request_id="x" * (65 << 20)).SerializeToString()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in raw(huge)]
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await generate_ok(channel)
    assert verifier.engine.scheduler.block_manager.num_free_blocks == 64


async def test_malformed_propose_message_ends_that_stream_only() -> None:
    server, port = await start_drafter_server(NGRAM, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            raw = channel.stream_stream("/specdec.v1.Drafter/Propose")
            call = raw()
            await call.write(b"\xff\xff\xff\x07garbage")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed request to /specdec.v1.Drafter/Propose" in info.value.details()
            # Another stream on the same server works, and an unknown sequence that does
            # not start from its first token is asked to resync, not refused.
            stub = specdec_pb2_grpc.DrafterStub(channel)
            good = stub.Propose()
            await good.write(specdec_pb2.ProposeRequest(step_id=1, sequences=[
                specdec_pb2.SequenceUpdate(seq_id=9, new_token_ids=[3, 4], context_len=10,
                                           num_speculative_tokens=2)]))
            response = await good.read()
            assert response.step_id == 1 and response.drafts[0].needs_resync
            await good.done_writing()
    finally:
        await stop_drafter_server(server, grace_s=0)
