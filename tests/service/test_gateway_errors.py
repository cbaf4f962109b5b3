"""Gateway error paths: OpenAI error JSON for every rejection, never a 500 traceback."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from tests.support.fake_verifier import (
    REPLY_TEXT,
    SERVED_MODEL,
    FakeVerifier,
    FakeVerifierServer,
    LiveGateway,
    gateway_config,
    live_gateway,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway import VerifierClient

MESSAGES = [{"role": "user", "content": "What is the answer?"}]
CHAT = {"model": SERVED_MODEL, "messages": MESSAGES}
COMPLETION = {"model": SERVED_MODEL, "prompt": "Hello"}


def _servicer(tokenizer) -> FakeVerifier:
    return FakeVerifier(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                        tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def live(tokenizer) -> Iterator[tuple[LiveGateway, FakeVerifier]]:
    with live_gateway(tokenizer, _servicer(tokenizer)) as live:
        yield live


@pytest.fixture()
def fake(live) -> Iterator[FakeVerifier]:
    yield live[1]
    live[1].abort_code = None


def assert_openai_error(response: httpx.Response, status: int,
                        param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


INVALID_REQUESTS = [
    # (id, path, raw body or JSON, param named)
    ("invalid-json", "/v1/chat/completions", b'{"messages": [', None),
    ("invalid-utf8", "/v1/chat/completions", b'{"model": "\xff\xfe"}', None),
    ("nan-literal", "/v1/chat/completions", b'{"messages": [], "temperature": NaN}', None),
    ("not-an-object", "/v1/chat/completions", [1, 2], None),
    ("model-type", "/v1/chat/completions", {**CHAT, "model": 3}, "model"),
    ("messages-type", "/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("messages-missing", "/v1/chat/completions", {"model": SERVED_MODEL}, "messages"),
    ("messages-empty", "/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("unknown-role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("content-type", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ("temperature-type", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("temperature-negative", "/v1/chat/completions", {**CHAT, "temperature": -0.5},
     "temperature"),
    ("top-p-zero", "/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("top-p-above-one", "/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p"),
    ("top-k", "/v1/chat/completions", {**CHAT, "top_k": -2}, "top_k"),
    ("repetition-penalty", "/v1/chat/completions", {**CHAT, "repetition_penalty": 0},
     "repetition_penalty"),
    ("max-tokens-zero", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("max-tokens-string", "/v1/chat/completions", {**CHAT, "max_tokens": "5"}, "max_tokens"),
    ("max-completion-tokens", "/v1/chat/completions", {**CHAT, "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("n-zero", "/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("n-above-max-num-seqs", "/v1/chat/completions", {**CHAT, "n": 100_000}, "n"),
    ("stream-type", "/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ("stream-options-without-stream", "/v1/chat/completions",
     {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("stop-type", "/v1/chat/completions", {**CHAT, "stop": [1, 2]}, "stop"),
    ("stop-empty", "/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
    ("stop-token-ids", "/v1/chat/completions", {**CHAT, "stop_token_ids": [-1]},
     "stop_token_ids"),
    ("speculation-type", "/v1/chat/completions", {**CHAT, "speculation": "x"}, "speculation"),
    ("speculation-above-server-k", "/v1/chat/completions", {**CHAT, "speculation": 99},
     "speculation"),
    ("top-logprobs-range", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2},
     "top_logprobs"),
    ("chat-logprobs-type", "/v1/chat/completions", {**CHAT, "logprobs": 3}, "logprobs"),
    ("chat-prompt-too-long", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hello " * 300}]}, "messages"),
    ("prompt-plus-max-tokens-too-long", "/v1/chat/completions", {**CHAT, "max_tokens": 250},
     "max_tokens"),
    ("prompt-missing", "/v1/completions", {"model": SERVED_MODEL}, "prompt"),
    ("prompt-empty", "/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("prompt-batch", "/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}, "prompt"),
    ("prompt-token-out-of-vocab", "/v1/completions", {**COMPLETION, "prompt": [10**6]},
     "prompt"),
    ("completion-prompt-too-long", "/v1/completions", {**COMPLETION, "prompt": "hello " * 300},
     "prompt"),
    ("completion-logprobs-range", "/v1/completions", {**COMPLETION, "logprobs": 21},
     "logprobs"),
    ("presence-penalty-range", "/v1/chat/completions", {**CHAT, "presence_penalty": 2.5},
     "presence_penalty"),
    ("frequency-penalty-range", "/v1/chat/completions", {**CHAT, "frequency_penalty": -3},
     "frequency_penalty"),
    ("min-p-range", "/v1/chat/completions", {**CHAT, "min_p": 1.5}, "min_p"),
    ("min-tokens-negative", "/v1/chat/completions", {**CHAT, "min_tokens": -1}, "min_tokens"),
    ("min-tokens-above-max-tokens", "/v1/chat/completions",
     {**CHAT, "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("min-tokens-above-context", "/v1/completions", {**COMPLETION, "min_tokens": 10**6},
     "min_tokens"),
    ("logit-bias-type", "/v1/chat/completions", {**CHAT, "logit_bias": [1, 2]}, "logit_bias"),
    ("logit-bias-key", "/v1/chat/completions", {**CHAT, "logit_bias": {"a": 1}}, "logit_bias"),
    ("logit-bias-negative-key", "/v1/chat/completions", {**CHAT, "logit_bias": {"-1": 1}},
     "logit_bias"),
    ("logit-bias-range", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}},
     "logit_bias"),
    ("logit-bias-out-of-vocab", "/v1/completions", {**COMPLETION, "logit_bias": {"400": 1}},
     "logit_bias"),
    ("logit-bias-twice", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1, "05": 2}},
     "logit_bias"),
]

# Known OpenAI (and vLLM) fields specdec cannot honour: each non-default value is a 400
# naming the field, never silently ignored. (Structured outputs and tool calls are honoured:
# tests/service/test_structured_gateway.py, tests/service/test_tool_calls_gateway.py.)
UNSUPPORTED_FIELDS = [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("best_of", 2),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("service_tier", "flex"),
    ("store", True),
    ("metadata", {"k": "v"}),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("web_search_options", {}),
    ("allowed_token_ids", [1, 2]),
    ("bad_words", ["x"]),
    ("use_beam_search", True),
    ("prompt_logprobs", 1),
    ("parallel_tool_calls", "yes"),
]
# The same fields at their defaults: accepted and sent on.
DEFAULT_FIELDS = {
    "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "functions": [],
    "function_call": "none", "top_logprobs": 0, "logprobs": False, "n": 1, "best_of": 1,
    "modalities": ["text"], "service_tier": "auto", "store": False, "metadata": {},
    "bad_words": [], "use_beam_search": False, "parallel_tool_calls": False, "user": "u1",
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field,value", UNSUPPORTED_FIELDS,
                         ids=[f"{name}-{index}" for index, (name, _) in enumerate(UNSUPPORTED_FIELDS)])
def test_unsupported_fields_are_400_naming_them(base_url, fake, path, field, value):
    body = {**(CHAT if path == "/v1/chat/completions" else COMPLETION), field: value}
    num_requests = len(fake.requests)
    error = assert_openai_error(httpx.post(f"{base_url}{path}", json=body), 400, field)
    assert field in error["message"]
    assert len(fake.requests) == num_requests


def test_default_values_of_those_fields_are_accepted(base_url, fake):
    response = httpx.post(f"{base_url}/v1/chat/completions", json={**CHAT, **DEFAULT_FIELDS})
    assert response.status_code == 200, response.text


def test_store_zero_is_not_taken_for_false(base_url, fake):
    # 0 == False in Python; the JSON integer 0 is not the boolean default.
    response = httpx.post(f"{base_url}/v1/chat/completions", json={**CHAT, "store": 0})
    assert_openai_error(response, 400, "store")


def test_openai_client_sends_every_penalty_field(base_url, fake):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=6, presence_penalty=0.5,
        frequency_penalty=-1.25, logit_bias={"7": 10, "12": -100},
        extra_body={"min_tokens": 3, "min_p": 0.25})
    sampling = fake.requests[-1].sampling
    assert sampling.presence_penalty == 0.5 and sampling.frequency_penalty == -1.25
    assert dict(sampling.logit_bias) == {7: 10.0, 12: -100.0}
    assert sampling.min_tokens == 3 and sampling.min_p == 0.25
    client.completions.create(model=SERVED_MODEL, prompt="Hello", max_tokens=4,
                              presence_penalty=-2, frequency_penalty=2, logit_bias={"3": 1},
                              extra_body={"min_tokens": 4, "min_p": 1})
    sampling = fake.requests[-1].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-2.0, 2.0)
    assert dict(sampling.logit_bias) == {3: 1.0}
    assert sampling.min_tokens == 4 and sampling.min_p == 1.0
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES,
                                       response_format={"type": "xml"})  # type: ignore[typeddict-item]
    assert excinfo.value.body["param"] == "response_format.type"


@pytest.mark.parametrize("path,body,param", [case[1:] for case in INVALID_REQUESTS],
                         ids=[case[0] for case in INVALID_REQUESTS])
def test_invalid_requests_are_400(base_url, fake, path, body, param):
    num_requests = len(fake.requests)
    if isinstance(body, bytes):
        response = httpx.post(f"{base_url}{path}", content=body,
                              headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{base_url}{path}", json=body)
    error = assert_openai_error(response, 400, param)
    assert error["type"] == "invalid_request_error"
    assert len(fake.requests) == num_requests  # rejected before reaching the verifier


def test_unknown_model_is_404(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert raised.value.status_code == 404
    error = assert_openai_error(raised.value.response, 404, "model")
    assert "gpt-4" in error["message"]


def test_unknown_route_and_method_are_openai_json(base_url):
    assert_openai_error(httpx.get(f"{base_url}/v1/nothing"), 404)
    assert_openai_error(httpx.get(f"{base_url}/v1/chat/completions"), 405)


@pytest.mark.parametrize("code,status", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.INTERNAL, 500),
])
def test_verifier_status_codes_map_to_http(base_url, fake, code, status):
    fake.abort_code = code
    response = httpx.post(f"{base_url}/v1/chat/completions", json=CHAT)
    error = assert_openai_error(response, status)
    if status == 500:
        # Internal details stay in the log.
        assert "fake verifier failure" not in error["message"]


def test_overloaded_verifier_is_a_rate_limit_error(base_url, fake):
    fake.abort_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES)


def _wait_for_status(url: str, status: int, timeout_s: float = 10.0,
                     body: dict | None = None) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        response = (httpx.post(url, json=body, timeout=5) if body is not None
                    else httpx.get(url, timeout=5))
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_verifier_down_is_503_and_recovers_without_restart(tokenizer):
    server = FakeVerifierServer(_servicer(tokenizer))  # not started yet
    gateway = LiveGateway(gateway_config(server.address), tokenizer)
    gateway.start()
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
    chat_url = f"{gateway.base_url}/v1/chat/completions"
    try:
        assert httpx.get(f"{gateway.base_url}/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES)
        assert raised.value.status_code == 503
        assert_openai_error(raised.value.response, 503)

        server.start()
        assert _wait_for_status(f"{gateway.base_url}/health", 200).status_code == 200
        assert _wait_for_status(chat_url, 200, body=CHAT).status_code == 200

        server.stop()
        assert_openai_error(_wait_for_status(chat_url, 503, body=CHAT), 503)
        assert httpx.get(f"{gateway.base_url}/health").status_code == 503

        server.start()
        assert _wait_for_status(chat_url, 200, body=CHAT).status_code == 200
        completion = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES)
        assert completion.choices[0].message.content == REPLY_TEXT
    finally:
        gateway.stop()
        server.close()


def test_round_robin_skips_a_dead_verifier(tokenizer):
    live_servicer = _servicer(tokenizer)
    live_server = FakeVerifierServer(live_servicer)
    live_server.start()
    dead_server = FakeVerifierServer(_servicer(tokenizer))  # never started
    gateway = LiveGateway(gateway_config(dead_server.address, live_server.address), tokenizer)
    gateway.start()
    try:
        for _ in range(4):
            response = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=CHAT)
            assert response.status_code == 200
        assert len(live_servicer.requests) == 4
    finally:
        gateway.stop()
        live_server.close()
        dead_server.close()


class _BrokenVerifierClient(VerifierClient):
    async def generate(self, request):
        raise RuntimeError("secret internal detail")


def test_unexpected_exception_is_generic_500(tokenizer, live):
    address = gateway_config(*live[0].app.state.verifier.addresses).verifier_addresses
    gateway = LiveGateway(gateway_config(*address), tokenizer, _BrokenVerifierClient(address))
    gateway.start()
    try:
        response = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=CHAT)
        error = assert_openai_error(response, 500)
        assert "secret" not in response.text
        assert error["type"] == "server_error"
    finally:
        gateway.stop()


def test_api_key(tokenizer, live):
    address = live[0].app.state.verifier.addresses
    gateway = LiveGateway(gateway_config(*address, api_key="s3cret", max_request_bytes=4096),
                          tokenizer)
    gateway.start()
    url = gateway.base_url
    try:
        error = assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=CHAT), 401)
        assert error["type"] == "authentication_error"
        assert_openai_error(httpx.get(f"{url}/v1/models",
                                      headers={"Authorization": "Bearer wrong"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        completion = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES)
        assert completion.choices[0].message.content == REPLY_TEXT
        too_large = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=too_large,
                                       headers={"Authorization": "Bearer s3cret"}), 413)
    finally:
        gateway.stop()


_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8)
_field_names = st.sampled_from([
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "repetition_penalty", "stop", "stop_token_ids", "seed", "stream",
    "stream_options", "ignore_eos", "n", "speculation", "logprobs", "presence_penalty",
    "frequency_penalty", "min_p", "min_tokens", "logit_bias", "response_format", "tools"])
_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "wizard"])
    | _json,
    "content": st.text(max_size=20) | _json,
})
_bodies = st.one_of(
    _json,
    st.dictionaries(_field_names, _json, max_size=6),
    st.fixed_dictionaries(
        {"messages": st.lists(_message, max_size=3)},
        optional={"model": st.just(SERVED_MODEL) | _json,
                  "max_tokens": st.integers(-2, 300) | _json,
                  "temperature": st.floats(-1, 3) | _json,
                  "top_p": st.floats(-0.5, 1.5) | _json,
                  "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
                  "stream": st.booleans(),
                  "speculation": st.integers(-1, 5) | st.booleans()}),
)


@pytest.fixture(scope="module")
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=10) as client:
        yield client


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies)
def test_generated_bodies_never_500(http, body):
    response = http.post("/v1/chat/completions", json=body)
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
    else:
        assert response.json()["object"] == "chat.completion"
