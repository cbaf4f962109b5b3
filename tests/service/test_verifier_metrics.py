"""What the verifier tells the outside: drafter failures counted per replica and kind,
logged at a bounded rate, and its model named by its served name, never by a path."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from specdec.cli import served_model_name
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.engine.sampling_params import SamplingParams
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.engine_harness import generate
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig, build_engine
from verifier_svc.drafting.drafter_errors import DrafterErrors
from verifier_svc.drafting.drafter_pool import DrafterPool, DraftRequest
from verifier_svc.metrics import VerifierMetrics
from verifier_svc.server import start_verifier

K = 3
VOCAB_SIZE = 100
METRIC = "specdec:drafter_errors_total"
ERRORS_LOGGER = "verifier_svc.drafting.drafter_errors"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-metrics"))


# ------------------------------------------------------------------ fake drafters


class FakeDrafter(specdec_pb2_grpc.DrafterServicer):
    """An ngram drafter as GetInfo tells; what its Propose does is up to the subclass."""

    async def GetInfo(self, request, context):
        return specdec_pb2.DrafterInfo(method="ngram", max_num_speculative_tokens=K)


class NeverAnswers(FakeDrafter):
    async def Propose(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        return
        yield  # a generator that yields nothing


class BreaksEachStream(FakeDrafter):
    """Ends every stream with UNAVAILABLE at its first message, as a GOAWAY would."""

    async def Propose(self, request_iterator, context):
        async for _ in request_iterator:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Too many pings")
        yield  # pragma: no cover


class AnswersGarbage(FakeDrafter):
    async def Propose(self, request_iterator, context):
        async for request in request_iterator:
            response = specdec_pb2.ProposeResponse(step_id=request.step_id)
            for update in request.sequences:
                response.drafts.add(seq_id=update.seq_id, draft_token_ids=[VOCAB_SIZE + 1])
            yield response


@pytest.fixture
async def serve_drafter() -> AsyncIterator[Callable[[FakeDrafter], Awaitable[str]]]:
    servers: list[grpc.aio.Server] = []

    async def start(servicer: FakeDrafter) -> str:
        server = grpc.aio.server()
        specdec_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)


@pytest.fixture
async def pool_for() -> AsyncIterator[Callable[..., Awaitable[DrafterPool]]]:
    pools: list[DrafterPool] = []

    async def start(address: str, healthy: bool = True) -> DrafterPool:
        pool = DrafterPool([address], vocab_size=VOCAB_SIZE, tokenizer_fingerprint="",
                           backoff_initial_s=0.01, backoff_max_s=0.02)
        pools.append(pool)
        await pool.start()
        if healthy:
            assert await pool.wait_for_healthy(1, timeout_s=10.0)
        return pool

    yield start
    for pool in pools:
        await pool.close()


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Polls `condition`; the timeout only guards against a hang."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def ask(seq_id: int = 1) -> list[DraftRequest]:
    return [DraftRequest(seq_id, [1, 2, 3, 1, 2], 0, K)]


def records(caplog: pytest.LogCaptureFixture, address: str, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == ERRORS_LOGGER and address in r.getMessage() and text in r.getMessage()
            and r.levelno > logging.DEBUG]


# ------------------------------------------------------------------ counting and logging


async def test_timeouts_are_counted_and_logged_once_per_burst(serve_drafter, pool_for, caplog):
    address = await serve_drafter(NeverAnswers())
    pool = await pool_for(address)
    with caplog.at_level(logging.DEBUG, logger=ERRORS_LOGGER):
        for _ in range(5):
            assert await pool.propose(ask(), [], timeout_s=0.01) == {}
    assert pool.errors.counts == {(address, "timeout"): 5}
    assert len(records(caplog, address, "deadline")) == 1


async def test_a_flapping_stream_is_counted_each_time_and_logged_once(serve_drafter, pool_for,
                                                                       caplog):
    """The drafter drops every stream (as GOAWAY "too_many_pings" did): each break is
    counted as a stream error, the log line is not repeated for each."""
    address = await serve_drafter(BreaksEachStream())
    pool = await pool_for(address)
    with caplog.at_level(logging.DEBUG, logger=ERRORS_LOGGER):
        for _ in range(4):
            assert await pool.wait_for_healthy(1, timeout_s=10.0)
            # Returns once the stream broke (its step's future ends with no drafts).
            assert await pool.propose(ask(), [], timeout_s=10.0) == {}
        assert await until(lambda: pool.errors.counts.get((address, "stream_error"), 0) >= 4)
    assert len(records(caplog, address, "Too many pings")) == 1


async def test_bad_drafts_and_an_unreachable_drafter_are_counted(serve_drafter, pool_for, caplog):
    address = await serve_drafter(AnswersGarbage())
    pool = await pool_for(address)
    for seq_id in range(3):
        assert await pool.propose(ask(seq_id), [], timeout_s=5.0) == {}
    assert pool.errors.counts == {(address, "bad_response"): 3}

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{sock.getsockname()[1]}"
    with caplog.at_level(logging.DEBUG, logger=ERRORS_LOGGER):
        down = await pool_for(closed, healthy=False)
        assert await until(lambda: down.errors.counts.get((closed, "unavailable"), 0) >= 3)
    assert len(records(caplog, closed, "unavailable")) == 1  # the rest at DEBUG


def test_the_log_holds_back_repeats_and_says_how_many(caplog) -> None:
    now = [100.0]
    errors = DrafterErrors(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=ERRORS_LOGGER):
        for _ in range(4):
            errors.record("a:1", "timeout", "late")
        errors.record("a:1", "stream_error", "broke")  # another kind: its own limit
        errors.record("b:1", "timeout", "late")       # another replica: its own limit
        now[0] += 10.0
        errors.record("a:1", "timeout", "late")
    messages = [r.getMessage() for r in caplog.records if r.name == ERRORS_LOGGER]
    assert messages == ["drafter a:1: late", "drafter a:1: broke", "drafter b:1: late",
                        "drafter a:1: late (3 more timeout errors in the last 10 s not logged)"]
    assert errors.counts == {("a:1", "timeout"): 5, ("a:1", "stream_error"): 1,
                             ("b:1", "timeout"): 1}
    errors.forget("a:1")
    assert errors.counts == {("b:1", "timeout"): 1}


async def test_the_engines_drafter_errors_reach_prometheus(tiny_model: Path, device,
                                                           serve_drafter) -> None:
    address = await serve_drafter(NeverAnswers())
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    engine, served = build_engine(build_config(VerifierConfig,
        model=str(tiny_model), device=str(device), dtype="float32", max_model_len=128,
        block_size=4, num_kv_blocks=64, speculative_config=spec,
        drafter_targets=(address,), draft_timeout_s=0.01, adaptive_speculation=False))
    assert engine.metrics is None  # counted whether or not metrics are exported
    await engine.start()
    try:
        assert await engine.drafter_pool.wait_for_healthy(1, timeout_s=10.0)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        assert len(await generate(engine, [5, 6, 7, 5, 6, 7, 5], params)) == 6
        metrics = VerifierMetrics(engine, served.model_name)
        labels = {"model_name": tiny_model.name, "replica": address, "kind": "timeout"}
        value = metrics.registry.get_sample_value(METRIC, labels)
        assert value == engine.drafter_pool.errors.counts[(address, "timeout")] >= 1
    finally:
        await engine.stop()


# ------------------------------------------------------------------ the model's name


async def test_get_info_and_metrics_name_the_model_never_its_path(tiny_model: Path, device) -> None:
    for given, expected in ((None, tiny_model.name), ("smollm2-135m-instruct",) * 2):
        config = build_config(VerifierConfig, model=str(tiny_model), served_model_name=given,
                              device=str(device), dtype="float32", max_model_len=128,
                              block_size=4, num_kv_blocks=64)
        running = await start_verifier(config, "127.0.0.1", 0, metrics_port=0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                info = await specdec_pb2_grpc.VerifierStub(channel).GetInfo(
                    specdec_pb2.GetVerifierInfoRequest())
            exported = generate_latest(running.engine.metrics.registry).decode()
        finally:
            await running.stop()
        assert info.model_name == expected
        assert str(tiny_model.parent).encode() not in info.SerializeToString()
        assert f'model_name="{expected}"' in exported
        assert str(tiny_model.parent) not in exported


def test_the_served_name_of_a_model() -> None:
    assert served_model_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert served_model_name("/srv/models/SmolLM2-135M/") == "SmolLM2-135M"
    assert served_model_name("/srv/models/smol-q4.gguf") == "smol-q4"
    assert served_model_name("/srv/models/x", "chosen") == "chosen"


def test_the_launcher_gives_the_verifier_the_name_not_the_path() -> None:
    import argparse

    from specdec.launcher import _child_commands, add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    commands = dict(_child_commands(parser.parse_args([]), "/cache/converted/smollm2"))
    verifier = commands["verifier"]
    assert verifier[verifier.index("--served-model-name") + 1] == "smollm2-135m-instruct"
    commands = dict(_child_commands(parser.parse_args(["--served-model-name", "mine"]), "/x"))
    assert commands["verifier"][commands["verifier"].index("--served-model-name") + 1] == "mine"


async def test_prefix_cache_queries_and_hits_reach_prometheus(tiny_model: Path, device) -> None:
    for caching in (True, False):
        engine, served = build_engine(build_config(VerifierConfig,
            model=str(tiny_model), device=str(device), dtype="float32", max_model_len=128,
            block_size=4, num_kv_blocks=64, enable_prefix_caching=caching))
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # two full blocks, then two tokens
            await generate(engine, prompt, params)
            await generate(engine, prompt, params)
            metrics = VerifierMetrics(engine, served.model_name)
            labels = {"model_name": tiny_model.name}
            queries = metrics.registry.get_sample_value("vllm:prefix_cache_queries_total", labels)
            hits = metrics.registry.get_sample_value("vllm:prefix_cache_hits_total", labels)
        finally:
            await engine.stop()
        assert (queries, hits) == ((20, 8) if caching else (0, 0))
