"""Two verifier replicas behind one gateway (issue #28, item 8): a request whose verifier
fails before the first token moves once to the other and the client sees no error; one
that fails after tokens were streamed ends with an error event, then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import httpx
import pytest

from tests.support.fake_verifier import (
    REPLY_TEXT,
    SERVED_MODEL,
    BackgroundLoop,
    FakeVerifier,
    FakeVerifierServer,
    LiveGateway,
    build_tiny_tokenizer,
    gateway_config,
)

from gateway import VerifierClient
from specdec.v1 import specdec_pb2

MESSAGES = [{"role": "user", "content": "What is the answer?"}]
CHAT = {"model": SERVED_MODEL, "messages": MESSAGES}
CHAT_URL = "/v1/chat/completions"


class FailingVerifier(FakeVerifier):
    """A FakeVerifier whose Generate fails in a chosen way:
    abort_before: an error status before any response; eof: the stream ends without a
    response; empty_then_abort: a response without tokens, then an error status;
    abort_after_tokens: one response with tokens, then an error status."""

    def __init__(self, tokenizer: Any, mode: str,
                 code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                         tokenizer.eos_token_id)
        self.mode = mode
        self.code = code

    async def Generate(self, request: specdec_pb2.GenerateRequest, context: Any):
        self.requests.append(request)
        if self.mode == "eof":
            return
        if self.mode == "empty_then_abort":
            yield specdec_pb2.GenerateResponse()
        elif self.mode == "abort_after_tokens":
            yield specdec_pb2.GenerateResponse(token_ids=self.reply_token_ids[:4])
        await context.abort(self.code, "fake verifier failure")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@contextmanager
def replicas(tokenizer: Any, *servicers: FakeVerifier,
             reprobe_interval_s: float = 3600) -> Iterator[tuple[str, list[FakeVerifierServer]]]:
    """A gateway over `servicers`, in this order; round-robin starts with the first."""
    servers = [FakeVerifierServer(servicer) for servicer in servicers]
    for server in servers:
        server.start()
    addresses = [server.address for server in servers]
    # Rare probes: a replica that failed stays as the gateway last saw it.
    client = VerifierClient(addresses, reprobe_interval_s=reprobe_interval_s)
    gateway = LiveGateway(gateway_config(*addresses), tokenizer, client)
    gateway.start()
    try:
        yield gateway.base_url, servers
    finally:
        gateway.stop()
        for server in servers:
            server.close()


def sse_events(response: httpx.Response) -> list[str]:
    events = [event for event in response.text.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events), events
    return [event[len("data: "):] for event in events]


def streamed_text(events: list[str]) -> str:
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks
                   if chunk.get("choices"))


def ask(base_url: str, stream: bool) -> httpx.Response:
    return httpx.post(f"{base_url}{CHAT_URL}", json={**CHAT, "stream": stream}, timeout=30)


@pytest.mark.parametrize("mode,code", [
    ("abort_before", grpc.StatusCode.UNAVAILABLE),
    ("abort_before", grpc.StatusCode.INTERNAL),
    ("abort_before", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("eof", grpc.StatusCode.OK),
    ("empty_then_abort", grpc.StatusCode.UNAVAILABLE),
])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_failure_before_the_first_token_is_retried_on_the_other_replica(
        tokenizer, mode, code, stream):
    failing = FailingVerifier(tokenizer, mode, code)
    good = FakeVerifier(failing.reply_token_ids, failing.eos_token_id)
    with replicas(tokenizer, failing, good) as (base_url, _):
        response = ask(base_url, stream)
        assert response.status_code == 200, response.text
        if stream:
            events = sse_events(response)
            assert events[-1] == "[DONE]"
            assert not any('"error"' in event for event in events)
            assert streamed_text(events) == REPLY_TEXT
        else:
            assert response.json()["choices"][0]["message"]["content"] == REPLY_TEXT
    assert len(failing.requests) == 1 and len(good.requests) == 1
    assert failing.requests[0].request_id == good.requests[0].request_id


def test_a_replica_that_stopped_is_skipped_by_the_retry(tokenizer):
    stopped = FakeVerifier([5, 6], tokenizer.eos_token_id)
    good = FakeVerifier(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                        tokenizer.eos_token_id)
    with replicas(tokenizer, stopped, good) as (base_url, servers):
        servers[0].stop()  # still "serving" for the gateway: probes are rare here
        response = ask(base_url, stream=True)
        assert response.status_code == 200
        assert streamed_text(sse_events(response)) == REPLY_TEXT
        assert httpx.get(f"{base_url}/health").json()["verifiers"] == {
            "verifier-0": "unreachable", "verifier-1": "serving"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_failure_on_both_replicas_is_one_clean_error(tokenizer, stream):
    first = FailingVerifier(tokenizer, "abort_before", grpc.StatusCode.INTERNAL)
    second = FailingVerifier(tokenizer, "abort_before", grpc.StatusCode.INTERNAL)
    third = FailingVerifier(tokenizer, "abort_before", grpc.StatusCode.INTERNAL)
    with replicas(tokenizer, first, second, third) as (base_url, _):
        response = ask(base_url, stream)
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"
        assert "fake verifier failure" not in response.text
    # Retried once, not on every replica.
    assert [len(s.requests) for s in (first, second, third)] == [1, 1, 0]


def test_unreachable_replicas_are_a_503_that_names_no_address(tokenizer):
    servicers = [FakeVerifier([5], tokenizer.eos_token_id) for _ in range(2)]
    with replicas(tokenizer, *servicers) as (base_url, servers):
        for server in servers:
            server.stop()
        response = ask(base_url, stream=False)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable_error"
        for server in servers:
            assert str(server.port) not in response.text


def test_a_request_error_is_not_retried(tokenizer):
    invalid = FailingVerifier(tokenizer, "abort_before", grpc.StatusCode.INVALID_ARGUMENT)
    good = FakeVerifier(invalid.reply_token_ids, invalid.eos_token_id)
    with replicas(tokenizer, invalid, good) as (base_url, _):
        response = ask(base_url, stream=False)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "fake verifier failure"
    assert len(invalid.requests) == 1 and good.requests == []


@pytest.mark.parametrize("code,status", [(grpc.StatusCode.UNAVAILABLE, 503),
                                         (grpc.StatusCode.INTERNAL, 500)])
def test_a_failure_after_tokens_ends_the_stream_with_an_error_event(tokenizer, code, status):
    servicers = [FailingVerifier(tokenizer, "abort_after_tokens", code) for _ in range(2)]
    with replicas(tokenizer, *servicers) as (base_url, servers):
        response = ask(base_url, stream=True)
        assert response.status_code == 200  # the headers left with the first chunk
        events = sse_events(response)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == ("server_error" if status == 500
                                 else "service_unavailable_error")
        assert error["message"] and "fake verifier failure" not in error["message"]
        assert str(servers[0].port) not in response.text
        # What came before the error is the reply's beginning.
        assert REPLY_TEXT.startswith(streamed_text(events[:-2]))
    # Not retried: the client had seen tokens.
    assert sum(len(s.requests) for s in servicers) == 1


def test_a_non_streaming_failure_after_tokens_is_a_5xx_error(tokenizer):
    servicers = [FailingVerifier(tokenizer, "abort_after_tokens") for _ in range(2)]
    with replicas(tokenizer, *servicers) as (base_url, _):
        response = ask(base_url, stream=False)
        assert response.status_code == 503
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert sum(len(s.requests) for s in servicers) == 1


class SaturatedVerifier(FakeVerifier):
    """A FakeVerifier with `num_slots` slots, all taken by slow streams: one more request is
    refused with RESOURCE_EXHAUSTED, and probes wait out their deadline (busy)."""

    def __init__(self, tokenizer: Any, num_slots: int) -> None:
        super().__init__(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                         tokenizer.eos_token_id)
        self.num_slots = num_slots
        self.num_running = 0
        self.delay_s = 0.02

    async def Generate(self, request: specdec_pb2.GenerateRequest, context: Any):
        if self.num_running >= self.num_slots:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full")
        self.num_running += 1
        try:
            async for response in super().Generate(request, context):
                yield response
        finally:
            self.num_running -= 1


def test_a_saturated_verifier_gets_no_503_only_429_beyond_its_slots(tokenizer):
    """Issue 44 item 4: probes that queue behind a busy engine time out together; they must
    not take the only verifier offline while it serves (and refuses) requests."""
    servicer = SaturatedVerifier(tokenizer, num_slots=4)
    server = FakeVerifierServer(servicer)
    server.start()
    client = VerifierClient([server.address], probe_timeout_s=0.02, reprobe_interval_s=0.01)
    gateway = LiveGateway(gateway_config(server.address), tokenizer, client)
    gateway.start()
    servicer.info_delay_s = 0.5  # every probe from now on runs out of time
    request = {**CHAT, "max_tokens": 24, "ignore_eos": True}
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            statuses = []
            for _ in range(6):  # waves of twice the slots: each longer than many probes
                statuses += list(pool.map(
                    lambda _: httpx.post(f"{gateway.base_url}{CHAT_URL}", json=request,
                                         timeout=30).status_code, range(8)))
        assert client.serving
    finally:
        gateway.stop()
        server.close()
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 6 * 4 // 2 and 429 in statuses, statuses


def test_probe_timeouts_mark_a_verifier_down_only_after_a_silence(tokenizer):
    """A probe that runs out of time is no evidence while the verifier answers calls; one
    silent for silent_down_s is hung. A refused connection is down at once."""
    servicer = FakeVerifier([5], tokenizer.eos_token_id)
    server = FakeVerifierServer(servicer)
    server.start()
    loop = BackgroundLoop()
    # Margins of seconds, not milliseconds: a loaded machine must not turn an answer in
    # time into a timeout, nor three slow probes into a silence.
    client = VerifierClient([server.address], probe_timeout_s=0.5, reprobe_interval_s=3600,
                            silent_down_s=3.0)
    try:
        loop.run(client.start())
        assert client.serving
        servicer.info_delay_s = 1.5
        for _ in range(3):  # three slow probes in a row, 1.5 s of silence: still up
            assert loop.run(client.probe_all())
            assert client.serving and client.statuses() == {"verifier-0": "serving"}
        servicer.info_delay_s = 0.0
        assert loop.run(client.probe_all())  # an answer in time: alive again
        servicer.info_delay_s = 1.5
        assert loop.run(client.probe_all())
        time.sleep(3.0)
        assert not loop.run(client.probe_all())  # silent for silent_down_s: hung
        assert not client.serving and client.statuses() == {"verifier-0": "unreachable"}
        servicer.info_delay_s = 0.0
        assert loop.run(client.probe_all()) and client.serving
        server.stop()  # a refused connection is down at once
        assert not loop.run(client.probe_all())
        assert not client.serving
    finally:
        loop.run(client.close())
        loop.close()
        server.close()


def test_concurrent_probes_of_one_verifier_share_one_call(tokenizer):
    servicer = FakeVerifier([5], tokenizer.eos_token_id)
    calls = []
    get_info = servicer.GetInfo

    async def counted(request: Any, context: Any) -> specdec_pb2.VerifierInfo:
        calls.append(request)
        return await get_info(request, context)

    servicer.GetInfo = counted
    server = FakeVerifierServer(servicer)
    server.start()
    loop = BackgroundLoop()
    client = VerifierClient([server.address], reprobe_interval_s=3600)
    try:
        loop.run(client.start())
        calls.clear()
        servicer.info_delay_s = 0.1

        async def many() -> list[bool]:
            return await asyncio.gather(*(client.probe_all() for _ in range(20)))

        assert all(loop.run(many()))
        assert len(calls) == 1
    finally:
        loop.run(client.close())
        loop.close()
        server.close()
