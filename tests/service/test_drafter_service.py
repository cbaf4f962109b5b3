"""The drafter service in-process on port 0: servicer semantics, health, reflection, CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from drafter_svc.ngram_proposer import NgramProposer
from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

K = 3
CONFIG = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})


@pytest.fixture
async def channel():
    server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield chan
    await stop_drafter_server(server, grace_s=0)


class Stream:
    """One Propose stream driven a request at a time."""

    def __init__(self, chan: grpc.aio.Channel) -> None:
        self.call = specdec_pb2_grpc.DrafterStub(chan).Propose()
        self.step_id = 0

    async def step(self, sequences: list[dict], finished: list[int] = ()
                   ) -> dict[int, specdec_pb2.SequenceDraft]:
        self.step_id += 1
        await self.call.write(specdec_pb2.ProposeRequest(
            step_id=self.step_id, finished_seq_ids=list(finished),
            sequences=[specdec_pb2.SequenceUpdate(**fields) for fields in sequences]))
        response = await self.call.read()
        assert response.step_id == self.step_id
        return {draft.seq_id: draft for draft in response.drafts}


def update(seq_id: int, new: list[int], context_len: int, k: int = K, **fields) -> dict:
    return dict(seq_id=seq_id, new_token_ids=new, context_len=context_len,
                num_speculative_tokens=k, **fields)


async def test_get_info(channel):
    info = await specdec_pb2_grpc.DrafterStub(channel).GetInfo(specdec_pb2.GetDrafterInfoRequest())
    assert (info.method, info.max_num_speculative_tokens) == ("ngram", K)
    assert list(info.hidden_state_layer_ids) == []
    assert (info.vocab_size, info.tokenizer_fingerprint) == (0, "")


async def test_health_serving(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "specdec.v1.Drafter"):
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_health_not_serving_on_shutdown():
    server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        await server.set_serving(False)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
    await stop_drafter_server(server, grace_s=0)


async def test_reflection_lists_services():
    # Off by default (tests/stack/test_internal_auth.py); --enable-reflection.
    server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0, enable_reflection=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        response = await call.read()
        await call.done_writing()
    await stop_drafter_server(server, grace_s=0)
    names = {service.name for service in response.list_services_response.service}
    assert {"specdec.v1.Drafter", "grpc.health.v1.Health"} <= names


async def test_proposals_equal_ngram_proposer_incrementally(channel):
    stream = Stream(channel)
    matcher = NgramProposer(1, 3, K)
    contexts = {1: [1, 2, 3, 4, 1, 2], 2: [9, 8, 7, 6, 5]}
    drafts = await stream.step([update(s, c, len(c)) for s, c in contexts.items()])
    assert list(drafts[1].draft_token_ids) == matcher.propose(contexts[1], K) == [3, 4, 1]
    assert 2 not in drafts  # no match, no draft entry
    for new in ([3], [4, 1, 2, 3], [7, 7]):
        for context in contexts.values():
            context += new
        drafts = await stream.step([update(s, new, len(c), num_accepted_tokens=1)
                                    for s, c in contexts.items()])
        for seq_id, context in contexts.items():
            expected = matcher.propose(context, K)
            got = list(drafts[seq_id].draft_token_ids) if seq_id in drafts else []
            assert got == expected


async def test_k_is_clamped_and_zero_means_sync_only(channel):
    stream = Stream(channel)
    context = [5, 6, 7, 8, 9, 5, 6]
    drafts = await stream.step([update(1, context, len(context), k=0)])
    assert drafts == {}
    drafts = await stream.step([update(1, [7], len(context) + 1, k=100)])
    assert list(drafts[1].draft_token_ids) == [8, 9, 5]  # K = 3, not 100


async def test_state_mismatch_answers_needs_resync(channel):
    stream = Stream(channel)
    # Unknown sequence whose update does not start at token 0.
    drafts = await stream.step([update(7, [1, 2], context_len=10)])
    assert drafts[7].needs_resync and not drafts[7].draft_token_ids
    # Known sequence whose length disagrees: resync, and its state is dropped.
    await stream.step([update(8, [1, 2, 1], 3)])
    drafts = await stream.step([update(8, [2], context_len=9)])
    assert drafts[8].needs_resync
    drafts = await stream.step([update(8, [1], context_len=4)])
    assert drafts[8].needs_resync  # state was dropped: increments no longer fit
    # A full context always (re)starts the sequence.
    drafts = await stream.step([update(8, [1, 2, 1, 2, 1], 5)])
    assert list(drafts[8].draft_token_ids) == [2, 1]


async def test_finished_ids_drop_state(channel):
    stream = Stream(channel)
    await stream.step([update(3, [1, 2, 1], 3)])
    drafts = await stream.step([], finished=[3, 99])
    assert drafts == {}
    drafts = await stream.step([update(3, [2], 4)])
    assert drafts[3].needs_resync


async def test_hidden_states_are_ignored_for_ngram(channel):
    stream = Stream(channel)
    bogus = specdec_pb2.Tensor(data=b"\x00" * 3, dtype="float99", shape=[7, 7])
    drafts = await stream.step([update(1, [4, 5, 4], 3, hidden_states=bogus)])
    assert list(drafts[1].draft_token_ids) == [5, 4]


async def test_streams_have_separate_state(channel):
    first, second = Stream(channel), Stream(channel)
    await first.step([update(1, [1, 2, 1], 3)])
    drafts = await second.step([update(1, [2], 4)])
    assert drafts[1].needs_resync


async def test_duplicate_seq_id_aborts_with_invalid_argument(channel):
    stream = Stream(channel)
    await stream.call.write(specdec_pb2.ProposeRequest(step_id=1, sequences=[
        specdec_pb2.SequenceUpdate(**update(1, [1], 1)),
        specdec_pb2.SequenceUpdate(**update(1, [1], 1))]))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stream.call.read()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "twice" in error.value.details()


async def test_model_methods_refuse_a_missing_model():
    config = SpeculativeConfig.parse({"method": "eagle", "model": "some/eagle-head",
                                      "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="'some/eagle-head' not found"):
        await start_drafter_server(config, "127.0.0.1", 0)


def test_cli_help_and_startup_error():
    result = subprocess.run([sys.executable, "-m", "drafter_svc", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--speculative-config", "--host", "--port", "--log-level", "--target-model",
                 "--dtype", "--device", "--num-blocks", "--draft-sampling"):
        assert flag in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "drafter_svc", "--port", "0", "--speculative-config",
         '{"method": "draft_model", "model": "m", "num_speculative_tokens": 2}'],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "model 'm' not found" in result.stderr


def test_cli_serves_and_stops_on_sigterm():
    process = subprocess.Popen(
        [sys.executable, "-m", "drafter_svc", "--port", "0", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 2}'],
        stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in process.stderr:
            if "drafter serving on" in line:
                port = int(line.split("127.0.0.1:")[1].split(":")[0])
                break
        assert port
        async def check() -> int:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
                response = await health_pb2_grpc.HealthStub(chan).Check(
                    health_pb2.HealthCheckRequest(service=""))
                return response.status
        assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING
        process.terminate()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


async def test_metrics_count_steps_drafts_and_resyncs():
    import httpx

    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        metrics_port = sock.getsockname()[1]
    server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0, metrics_port=metrics_port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            call = specdec_pb2_grpc.DrafterStub(chan).Propose()
            await call.write(specdec_pb2.ProposeRequest(step_id=1, sequences=[
                specdec_pb2.SequenceUpdate(seq_id=1, new_token_ids=[1, 2, 3, 1, 2], context_len=5,
                                           num_speculative_tokens=2),
                specdec_pb2.SequenceUpdate(seq_id=2, new_token_ids=[4], context_len=9,
                                           num_speculative_tokens=2)]))
            response = await call.read()
            await call.done_writing()
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    finally:
        await stop_drafter_server(server, grace_s=0)
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    drafted = sum(len(d.draft_token_ids) for d in response.drafts)
    assert drafted > 0
    assert values["specdec:drafter_steps_total"] == 1
    assert values["specdec:drafter_sequence_updates_total"] == 2
    assert values["specdec:drafter_draft_tokens_total"] == drafted
    assert values["specdec:drafter_resyncs_total"] == 1
    assert values["specdec:drafter_step_seconds_count"] == 1
