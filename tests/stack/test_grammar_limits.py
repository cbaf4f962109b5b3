"""Grammar limits before admission (issue 44, items 2 and 3).

A constraint is checked in a process of its own under a time budget: past it the request
is a 400 naming the field and the worker is killed; a check whose request ends (the call
cancelled, the client gone) kills its worker too, and the next check gets a fresh one. On
the verifier that check is the whole compile and probe with the model's tokenizer: nothing
is compiled in-process for a grammar refused or abandoned there. A choice longer than
llguidance's row limit is a 400 naming it, and a grammar whose first tokens already take
llguidance past its limits (`(a{1000}){1000}`) is refused by the verifier's probe before
admission.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import torch

from specdec.errors import InvalidRequestError
from specdec.grammar_checker import GrammarChecker, GrammarLimits
from specdec.grammar_probe import PROBE_DEPTH
from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model
from tests.support.fake_verifier import (
    SERVED_MODEL,
    FakeVerifier,
    FakeVerifierServer,
    LiveGateway,
    build_tiny_tokenizer,
    gateway_config,
    live_gateway,
    openai_client,
)
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.grammar_decode import late_limit_grammar, make_padded_tiny_model
from tests.support.served_stack import served_stack
from tests.support.verifier_harness import verifier_starter
from verifier_svc.grammar import GrammarBackend

# Checked in ~25 s here (llguidance checks the patterns pairwise, ~n^3): far past the
# budgets below on any machine, and a check nobody cancels would hold its worker that long.
EXPENSIVE_SCHEMA = {"type": "object", "additionalProperties": False, "patternProperties": {
    f"^x{i}_[a-z]*$": {"type": "integer"} for i in range(400)}}
BUDGET_S = 0.5
# Only a guard against a hang: a killed worker is seen at once when it works.
HANG_GUARD_S = 30.0


async def test_a_check_past_its_budget_is_a_400_naming_the_field() -> None:
    checker = GrammarChecker(GrammarLimits(compile_timeout_s=BUDGET_S, compile_workers=1))
    try:
        with pytest.raises(InvalidRequestError) as refused:
            await checker.check("json_schema", json.dumps(EXPENSIVE_SCHEMA),
                                param="response_format.json_schema.schema")
        assert refused.value.param == "response_format.json_schema.schema"
        assert "took longer than 0.5 s to compile" in refused.value.message
        assert checker.num_killed == 1
        # The one worker was replaced: the next check is served.
        assert "regex" in await checker.check("regex", "[ab]{2}", param="regex")
    finally:
        await checker.close()


async def test_a_cancelled_check_kills_its_worker() -> None:
    checker = GrammarChecker(GrammarLimits(compile_timeout_s=600, compile_workers=1))
    try:
        check = asyncio.ensure_future(checker.check("json_schema", json.dumps(EXPENSIVE_SCHEMA),
                                                     param="x"))
        while not checker._workers:  # started
            await asyncio.sleep(0.01)
        worker = next(iter(checker._workers))
        await asyncio.sleep(0.2)
        check.cancel()
        with pytest.raises(asyncio.CancelledError):
            await check
        assert checker.num_killed == 1
        assert await asyncio.wait_for(worker.wait(), HANG_GUARD_S) != 0
        assert "regex" in await checker.check("regex", "[ab]{2}", param="regex")
    finally:
        await checker.close()


@pytest.fixture(scope="module")
def gateway(tokenizer) -> Iterator[LiveGateway]:
    limits = GrammarLimits(compile_timeout_s=2.0, compile_workers=1)
    with live_gateway(tokenizer, grammar_limits=limits) as (live, _):
        yield live


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> openai.OpenAI:
    return openai_client(gateway, timeout=60)


def _refused(client: openai.OpenAI, **fields: object) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=SERVED_MODEL, max_tokens=8,
                                       messages=[{"role": "user", "content": "Hi"}], **fields)
    return refused.value


def test_the_gateway_refuses_grammars_past_their_limits_naming_the_field(client) -> None:
    slow = _refused(client, response_format={"type": "json_schema", "json_schema": {
        "name": "slow", "schema": EXPENSIVE_SCHEMA}})
    assert slow.body["param"] == "response_format.json_schema.schema"
    assert "took longer than 2 s to compile" in slow.message
    choices = _refused(client, extra_body={"structured_outputs": {
        "choice": [f"option {i}" for i in range(20_000)]}})
    assert choices.body["param"] == "structured_outputs.choice"
    assert "20000 strings; at most 2000" in choices.message
    # Plain requests are served meanwhile and after.
    answer = client.chat.completions.create(model=SERVED_MODEL, max_tokens=4,
                                            messages=[{"role": "user", "content": "Hi"}])
    assert answer.choices[0].message.content


def test_a_client_that_leaves_cancels_its_grammar_check() -> None:
    tokenizer = build_tiny_tokenizer()
    server = FakeVerifierServer(FakeVerifier([5], tokenizer.eos_token_id))
    server.start()
    # A budget no check reaches here: only the client's leaving ends the check.
    gateway = LiveGateway(gateway_config(server.address, grammar_limits=GrammarLimits(
        compile_timeout_s=600, compile_workers=1)), tokenizer)
    gateway.start()
    try:
        body = {"model": SERVED_MODEL, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "slow", "schema": EXPENSIVE_SCHEMA}}}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=0.5)
        checker: GrammarChecker = gateway.app.state.grammar_checker
        deadline = time.monotonic() + HANG_GUARD_S
        while checker.num_killed == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert checker.num_killed == 1
    finally:
        gateway.stop()
        server.close()


@pytest.fixture(scope="module")
def model_tokenizer() -> Any:
    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def backend(model_tokenizer) -> GrammarBackend:
    return GrammarBackend(model_tokenizer, len(model_tokenizer))


async def running_worker(checker: GrammarChecker) -> asyncio.subprocess.Process:
    """The checker's one worker, once started."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not checker._workers and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return next(iter(checker._workers))


async def test_a_verifier_compile_past_its_budget_is_refused_and_stopped(model_tokenizer) -> None:
    backend = GrammarBackend(model_tokenizer, len(model_tokenizer), limits=GrammarLimits(
        compile_timeout_s=BUDGET_S, compile_workers=1))
    try:
        compile_task = asyncio.ensure_future(backend.compile_async(
            "json_schema", json.dumps(EXPENSIVE_SCHEMA), param="response_format.json_schema.schema"))
        worker = await running_worker(backend.checker)
        with pytest.raises(InvalidRequestError) as refused:
            await compile_task
        assert refused.value.param == "response_format.json_schema.schema"
        assert "took longer than 0.5 s to compile" in refused.value.message
        # The worker compiling it was killed, and nothing was compiled in-process.
        assert await asyncio.wait_for(worker.wait(), HANG_GUARD_S) == -signal.SIGKILL
        assert backend.checker.num_killed == 1
        assert backend.cache_info()["misses"] == 0
        await backend.compile_async("regex", "[ab]{2}")
    finally:
        await backend.close()


async def test_a_cancelled_verifier_compile_kills_its_worker(model_tokenizer) -> None:
    backend = GrammarBackend(model_tokenizer, len(model_tokenizer), limits=GrammarLimits(
        compile_timeout_s=600, compile_workers=1))
    try:
        compile_task = asyncio.ensure_future(backend.compile_async(
            "json_schema", json.dumps(EXPENSIVE_SCHEMA)))
        worker = await running_worker(backend.checker)
        await asyncio.sleep(1.0)  # started, or compiling: either way it is killed
        compile_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await compile_task
        assert await asyncio.wait_for(worker.wait(), HANG_GUARD_S) == -signal.SIGKILL
        assert backend.checker.num_killed == 1
        assert backend.cache_info()["misses"] == 0
        await backend.compile_async("regex", "[ab]{2}")
        assert backend.cache_info()["misses"] == 1
    finally:
        await backend.close()


@pytest.fixture(scope="module")
def model_dir(model_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("limits-target")
    make_padded_tiny_model(model_tokenizer.eos_token_id).save_pretrained(path)
    model_tokenizer.save_pretrained(path)
    return path


async def test_a_cancelled_generate_call_kills_its_compile(model_dir: Path) -> None:
    """Through the verifier's gRPC service: the caller cancelling its Generate call while
    the grammar compiles kills the worker compiling it; nothing compiles in-process."""
    async with verifier_starter(model_dir, torch.device("cpu"), num_blocks=64) as start:
        verifier = await start(grammar_limits=GrammarLimits(compile_timeout_s=600,
                                                            compile_workers=1))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
            stub = specdec_pb2_grpc.VerifierStub(channel)
            call = stub.Generate(specdec_pb2.GenerateRequest(
                request_id="slow", prompt_token_ids=[1, 2, 3],
                sampling=specdec_pb2.SamplingParams(max_tokens=4, grammar=specdec_pb2.GrammarSpec(
                    kind="json_schema", value=json.dumps(EXPENSIVE_SCHEMA)))))
            deadline = time.monotonic() + HANG_GUARD_S
            while verifier.engine.grammars._backend is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            backend = verifier.engine.grammars._backend
            assert backend is not None
            worker = await running_worker(backend.checker)
            await asyncio.sleep(1.0)
            call.cancel()
            assert await asyncio.wait_for(worker.wait(), HANG_GUARD_S) == -signal.SIGKILL
            assert backend.checker.num_killed == 1
            assert backend.cache_info()["misses"] == 0


def test_the_verifiers_refusal_reaches_the_client_naming_its_field(model_dir: Path) -> None:
    """Through the launched stack: the gateway's check passes `(a{1000}){1000}` (its
    validation takes ~1 ms), the verifier's admission (compile and probe with the model's
    tokenizer) refuses it, and the client's 400 names the field it sent. Plain requests go
    on."""
    with served_stack(model_dir, "--grammar-compile-timeout-s", "600",
                      ready_timeout_s=120) as stack:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", timeout=120)
        model = client.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, max_tokens=8,
                                           messages=[{"role": "user", "content": "Hi"}],
                                           extra_body={"guided_regex": "(a{1000}){1000}"})
        assert refused.value.body["param"] == "guided_regex"
        assert "exceeds the grammar library's limits" in refused.value.body["message"]
        answer = client.chat.completions.create(model=model, max_tokens=4,
                                                messages=[{"role": "user", "content": "Hi"}])
        assert answer.choices[0].finish_reason == "length"


async def test_a_grammar_costly_only_with_the_tokenizer_never_compiles_in_process(
        model_tokenizer) -> None:
    """`(a{1000}){1000}` validates in ~1 ms without a tokenizer, but its compile with the
    model's tokenizer takes seconds before it fails: that compile is the worker's, under the
    budget (refused for time or for llguidance's limits, whichever comes first here)."""
    backend = GrammarBackend(model_tokenizer, len(model_tokenizer), limits=GrammarLimits(
        compile_timeout_s=BUDGET_S, compile_workers=1))
    try:
        with pytest.raises(InvalidRequestError) as refused:
            await backend.compile_async("regex", "(a{1000}){1000}", param="regex")
        assert refused.value.param == "regex"
        assert backend.cache_info()["misses"] == 0
    finally:
        await backend.close()


async def test_the_verifier_probes_in_its_worker(model_tokenizer) -> None:
    """A grammar past llguidance's limits in its first tokens is refused by the worker's
    probe: never compiled in-process, where its compile could not be stopped."""
    backend = GrammarBackend(model_tokenizer, len(model_tokenizer), limits=GrammarLimits(
        compile_timeout_s=600, compile_workers=1))
    try:
        with pytest.raises(InvalidRequestError) as refused:
            await backend.compile_async("grammar", late_limit_grammar(PROBE_DEPTH - 2),
                                        param="structured_outputs.grammar")
        assert refused.value.param == "structured_outputs.grammar"
        assert "exceeds the grammar library's limits" in refused.value.message
        assert backend.cache_info()["misses"] == 0
        # Past the probe's walk it is admitted (and fails later, its sequence alone:
        # tests/stack/test_sequence_faults.py).
        await backend.compile_async("grammar", late_limit_grammar(PROBE_DEPTH + 2))
        assert backend.cache_info()["misses"] == 1
    finally:
        await backend.close()


def test_the_verifier_probes_a_grammar_before_admission(backend: GrammarBackend) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        backend.compile("regex", "(a{1000}){1000}", param="structured_outputs.regex")
    assert refused.value.param == "structured_outputs.regex"
    assert "exceeds the grammar library's limits" in refused.value.message
    assert "(a{1000}){1000}" not in refused.value.message
    backend.compile("regex", "(a{10}){10}")


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
])
def test_a_cyclic_ref_that_matches_nothing_is_refused(backend: GrammarBackend, schema) -> None:
    """It used to give empty content with finish_reason stop (issue 44, item 9)."""
    with pytest.raises(InvalidRequestError) as refused:
        backend.compile("json_schema", json.dumps(schema), param="response_format.json_schema.schema")
    assert refused.value.param == "response_format.json_schema.schema"
    assert "matches no text at all" in refused.value.message
    # Recursion with a way out is a grammar like any other.
    backend.compile("json_schema", json.dumps(
        {"type": "object", "properties": {"child": {"$ref": "#"}}}))
