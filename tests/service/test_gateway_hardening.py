"""The gateway's public surface (issue #28, items 3, 5 and 12): it checks the verifier's
tokenizer, `/health` answers from memory, no response names a path, an internal address
or Python's internals, and hostile request bodies get clean 4xx answers."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.support.fake_verifier import (
    REPLY_TEXT,
    SERVED_MODEL,
    FakeVerifier,
    FakeVerifierServer,
    LiveGateway,
    build_tiny_tokenizer,
)

from gateway import GatewayConfig, VerifierClient
from gateway.chat import TEMPLATE_REJECTED_MESSAGE
from specdec.models.model_files import tokenizer_fingerprint
from specdec.v1 import specdec_pb2

MESSAGES = [{"role": "user", "content": "What is the answer?"}]
CHAT = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 4}
# A model directory that looks like a real one: no response may quote it.
MODEL_DIR = "/home/operator/secret-models/tiny-model"
CHAT_URL = "/v1/chat/completions"
# UndefinedError on "boom" (its text names Python types), the template's own rule on "rule".
TRAPPED_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] == 'boom' %}{{ message.nothing.deeper }}{% endif %}"
    "{% if message['content'] == 'rule' %}{{ raise_exception('Roles must alternate') }}"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class InfoVerifier(FakeVerifier):
    """Reports a chosen tokenizer fingerprint and counts GetInfo calls (one per probe)."""

    def __init__(self, tokenizer: Any, fingerprint: str) -> None:
        super().__init__(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                         tokenizer.eos_token_id)
        self.fingerprint = fingerprint
        self.info_calls = 0

    async def GetInfo(self, request: Any, context: Any) -> specdec_pb2.VerifierInfo:
        self.info_calls += 1
        info = await super().GetInfo(request, context)
        info.tokenizer_fingerprint = self.fingerprint
        return info


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TRAPPED_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def fingerprint(tokenizer) -> str:
    return tokenizer_fingerprint(tokenizer)


@contextmanager
def running(tokenizer: Any, *servicers: FakeVerifier, reprobe_interval_s: float = 1.0,
            **config: Any) -> Iterator[tuple[LiveGateway, list[FakeVerifierServer]]]:
    servers = [FakeVerifierServer(servicer) for servicer in servicers]
    for server in servers:
        server.start()
    addresses = [server.address for server in servers]
    client = VerifierClient(addresses, reprobe_interval_s=reprobe_interval_s)
    gateway = LiveGateway(GatewayConfig(model=MODEL_DIR, served_model_name=SERVED_MODEL,
                                        verifier_addresses=tuple(addresses), **config),
                          tokenizer, client)
    gateway.start()
    try:
        yield gateway, servers
    finally:
        gateway.stop()
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def live(tokenizer, fingerprint) -> Iterator[tuple[LiveGateway, InfoVerifier, str]]:
    servicer = InfoVerifier(tokenizer, fingerprint)
    # Probes are rare here, so counting calls is exact.
    with running(tokenizer, servicer, reprobe_interval_s=3600) as (gateway, servers):
        yield gateway, servicer, servers[0].address


@pytest.fixture(scope="module")
def http(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live[0].base_url, timeout=10) as client:
        yield client


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def post_raw(http: httpx.Client, body: bytes, path: str = CHAT_URL,
             content_type: str | None = "application/json") -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return http.post(path, content=body, headers=headers)


def assert_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error["message"]


def status_count(http: httpx.Client, status: int) -> float:
    wanted = f'specdec:gateway_http_requests_total{{endpoint="{CHAT_URL}",status="{status}"}}'
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# Item 3: the verifier's tokenizer.

def test_a_verifier_with_another_tokenizer_is_never_used(tokenizer, fingerprint, caplog):
    other = InfoVerifier(tokenizer, "0123456789abcdef")
    assert other.fingerprint != fingerprint
    caplog.set_level(logging.INFO, logger="gateway")
    with running(tokenizer, other, reprobe_interval_s=0.02) as (gateway, _):
        health = httpx.get(f"{gateway.base_url}/health")
        assert health.status_code == 503
        assert "tokenizer mismatch" in health.text
        assert health.json()["verifiers"] == {"verifier-0": "tokenizer_mismatch"}
        response = httpx.post(f"{gateway.base_url}{CHAT_URL}", json=CHAT)
        assert_error(response, 503)
        assert other.requests == []
        # Probed again and again, the mismatch is logged once.
        assert wait_for(lambda: other.info_calls >= 5)
    logged = [r for r in caplog.records if "serves another tokenizer" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR


def test_the_verifier_with_the_same_tokenizer_takes_every_request(tokenizer, fingerprint):
    other = InfoVerifier(tokenizer, "0123456789abcdef")
    same = InfoVerifier(tokenizer, fingerprint)
    with running(tokenizer, other, same) as (gateway, _):
        for _ in range(4):
            response = httpx.post(f"{gateway.base_url}{CHAT_URL}", json=CHAT)
            assert response.status_code == 200, response.text
        health = httpx.get(f"{gateway.base_url}/health")
        assert health.status_code == 200
        assert health.json()["verifiers"] == {"verifier-0": "tokenizer_mismatch",
                                              "verifier-1": "serving"}
        assert "tokenizer mismatch" in " ".join(health.json()["problems"])
    assert other.requests == [] and len(same.requests) == 4


# Item 5: /health from memory, and nothing internal in any unauthenticated answer.

def test_health_checks_cost_the_verifier_nothing(http, live):
    servicer = live[1]
    calls = servicer.info_calls
    for _ in range(50):
        assert http.get("/health").status_code == 200
    assert servicer.info_calls == calls


def test_health_follows_the_verifier_without_being_asked(tokenizer, fingerprint):
    with running(tokenizer, InfoVerifier(tokenizer, fingerprint),
                 reprobe_interval_s=0.05) as (gateway, [server]):
        url = f"{gateway.base_url}/health"
        assert httpx.get(url).status_code == 200
        server.stop()
        assert wait_for(lambda: httpx.get(url).status_code == 503)
        assert httpx.get(url).json()["verifiers"] == {"verifier-0": "unreachable"}
        server.start()
        assert wait_for(lambda: httpx.get(url).status_code == 200)


def assert_names_nothing_internal(response: httpx.Response, address: str) -> None:
    text = response.text
    port = address.rsplit(":", 1)[1]
    for secret in ("/home/operator", "secret-models", address, f":{port}", "Traceback",
                   'File "', "sys.set_int_max_str_digits", "recursion"):
        assert secret not in text, (response.request.url, text)


def test_no_answer_names_a_path_an_address_or_a_traceback(http, live):
    address = live[2]
    answers = [
        http.get("/health"), http.get("/v1/models"), http.get("/v1/nothing"),
        http.get(CHAT_URL), http.post(CHAT_URL, json={**CHAT, "model": "gpt-4"}),
        post_raw(http, b'{"messages": ['), post_raw(http, b"hello", content_type="text/plain"),
        http.post(CHAT_URL, json={**CHAT, "messages": [{"role": "user", "content": "boom"}]}),
    ]
    for response in answers:
        assert_names_nothing_internal(response, address)
    models = answers[1].json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(SERVED_MODEL, SERVED_MODEL)]
    assert set(answers[0].json()["verifiers"]) == {"verifier-0"}


def test_chat_template_errors_are_generic_400s(http):
    boom = http.post(CHAT_URL, json={**CHAT, "messages": [{"role": "user", "content": "boom"}]})
    assert assert_error(boom, 400) == TEMPLATE_REJECTED_MESSAGE
    # The template's own rule is the model's, and worth passing on.
    rule = http.post(CHAT_URL, json={**CHAT, "messages": [{"role": "user", "content": "rule"}]})
    assert "Roles must alternate" in assert_error(rule, 400)


# Item 12: hostile bodies.

@pytest.mark.parametrize("body", [
    b'{"model": "tiny-model", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
    b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}',
    b'{"messages": [{"role": "user", "content": "hi", "name": "a\\udc00"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": '
    b'{"name": "\\ud800"}}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}',
], ids=["content", "model", "stop", "name", "content-part", "tool-name", "key"])
def test_a_lone_surrogate_is_a_400(http, live, body):
    num_requests = len(live[1].requests)
    message = assert_error(post_raw(http, body), 400)
    assert "surrogate" in message
    assert len(live[1].requests) == num_requests


def test_a_lone_surrogate_in_a_completion_prompt_is_a_400(http):
    body = b'{"model": "tiny-model", "prompt": "hi \\ud800", "max_tokens": 2}'
    assert "surrogate" in assert_error(post_raw(http, body, "/v1/completions"), 400)


def test_a_surrogate_pair_is_ordinary_text(http):
    body = (b'{"model": "tiny-model", "max_tokens": 2, "messages": '
            b'[{"role": "user", "content": "hi \\ud83d\\ude00"}]}')
    assert post_raw(http, body).status_code == 200


@pytest.mark.parametrize("content_type", [
    None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
    "application/json; charset=latin-1", "application/jsonp"])
def test_only_json_bodies_are_read(http, live, content_type):
    num_requests = len(live[1].requests)
    response = post_raw(http, json.dumps(CHAT).encode(), content_type=content_type)
    assert_error(response, 415)
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert len(live[1].requests) == num_requests


@pytest.mark.parametrize("content_type", [
    "application/json", "Application/JSON", "application/json; charset=utf-8",
    'application/json;charset="UTF-8"'])
def test_json_content_types_are_read(http, content_type):
    assert post_raw(http, json.dumps(CHAT).encode(), content_type=content_type).status_code == 200


def test_a_huge_integer_is_a_clean_400(http):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}"
    message = assert_error(post_raw(http, body), 400)
    assert "digits" in message and "sys." not in message and "set_int" not in message


def test_deeply_nested_json_is_a_clean_400(http):
    body = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    message = assert_error(post_raw(http, body), 400)
    assert "nested too deeply" in message and "recursion" not in message


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_leaving_mid_body_is_a_quiet_499(http, live):
    handler = _Records()
    # uvicorn's own loggers do not propagate to the root logger.
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    before_499, before_500 = status_count(http, 499), status_count(http, 500)
    try:
        head = (f"POST {CHAT_URL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", live[0].port), timeout=10) as sock:
            sock.sendall(head + b'{"model": "tiny')
        assert wait_for(lambda: status_count(http, 499) == before_499 + 1)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert status_count(http, 500) == before_500
    loud = [r for r in handler.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]
