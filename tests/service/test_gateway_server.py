"""The gateway's HTTP server limits (issue #28, item 12): slow clients are closed, an
oversized head gets 431, and connections beyond the limit get 503. Real uvicorn servers
on free ports, configured by `gateway.server.uvicorn_config` with small timeouts."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from tests.support.fake_verifier import (
    REPLY_TEXT,
    SERVED_MODEL,
    FakeVerifier,
    FakeVerifierServer,
    build_tiny_tokenizer,
    free_port,
    gateway_config,
)

from gateway import create_app
from gateway.server import ServerLimits, uvicorn_config
from specdec.errors import ConfigError
from specdec.v1 import specdec_pb2

# Long enough for a loaded machine to send a head, short enough to wait for in a test.
SHORT_TIMEOUT_S = 0.5


class Served:
    def __init__(self, address: str, limits: ServerLimits) -> None:
        app = create_app(gateway_config(address), build_tiny_tokenizer())
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port,
                                                    log_level="warning", limits=limits))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.01)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def verifier() -> Iterator[str]:
    tokenizer = build_tiny_tokenizer()
    server = FakeVerifierServer(FakeVerifier(
        tokenizer.encode(REPLY_TEXT, add_special_tokens=False), tokenizer.eos_token_id))
    server.start()
    yield server.address
    server.close()


@pytest.fixture(scope="module")
def strict(verifier) -> Iterator[Served]:
    served = Served(verifier, ServerLimits(header_timeout_s=SHORT_TIMEOUT_S,
                                           body_timeout_s=SHORT_TIMEOUT_S))
    yield served
    served.stop()


def closed_by_server(sock: socket.socket, wait_s: float = 10.0) -> bool:
    """True when the server closed the connection (EOF or reset) within `wait_s`."""
    sock.settimeout(wait_s)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_that_sends_nothing_is_closed(strict):
    with strict.connect() as sock:
        assert closed_by_server(sock)


def test_a_stalled_request_head_is_closed(strict):
    with strict.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert closed_by_server(sock)


def test_a_trickled_request_head_is_closed(strict):
    """One header line at a time, each well inside the timeout: the deadline holds."""
    with strict.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        closed = False
        for index in range(400):
            readable, _, _ = select.select([sock], [], [], SHORT_TIMEOUT_S / 5)
            if readable:
                closed = closed_by_server(sock)
                break
            try:
                sock.sendall(f"X-Slow-{index}: 1\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed


def test_a_stalled_request_body_is_closed(strict):
    with strict.connect() as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"mo")
        assert closed_by_server(sock)
    # The waiting request saw a disconnect: a 499, not a server error.
    url = f"http://127.0.0.1:{strict.port}/metrics"
    wanted = 'specdec:gateway_http_requests_total{endpoint="/v1/chat/completions",status="499"}'
    deadline = time.monotonic() + 10
    while wanted not in httpx.get(url).text and time.monotonic() < deadline:
        time.sleep(0.02)
    text = httpx.get(url).text
    assert wanted in text and 'status="500"' not in text


def test_a_request_within_the_timeouts_is_served(strict):
    response = httpx.post(f"http://127.0.0.1:{strict.port}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 3})
    assert response.status_code == 200


def test_a_huge_request_head_gets_431(strict):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n"
    with strict.connect() as sock:
        try:
            sock.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the answer may already be waiting
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]


def test_connections_beyond_the_limit_get_503(verifier):
    served = Served(verifier, ServerLimits(limit_concurrency=2))
    try:
        with served.connect(), served.connect():
            response = httpx.get(f"http://127.0.0.1:{served.port}/health")
            assert response.status_code == 503
        # Once they are closed, requests are served again.
        deadline = time.monotonic() + 10
        while httpx.get(f"http://127.0.0.1:{served.port}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        served.stop()


class EndlessVerifier(FakeVerifier):
    """Serves a context long enough that a stream never ends before its client leaves."""

    async def GetInfo(self, request: Any, context: Any) -> specdec_pb2.VerifierInfo:
        info = await super().GetInfo(request, context)
        info.max_model_len = 10**7
        return info


def test_a_stream_its_client_stops_reading_is_closed_and_cancelled():
    """Issue 44 item 9: a held stream (the client reads nothing) holds its verifier
    sequence only for --timeout-response-stall, then its request is cancelled."""
    tokenizer = build_tiny_tokenizer()
    servicer = EndlessVerifier(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                               tokenizer.eos_token_id)
    server = FakeVerifierServer(servicer)
    server.start()
    served = Served(server.address, ServerLimits(write_stall_timeout_s=SHORT_TIMEOUT_S))
    # A small send buffer on the listening socket (accepted sockets inherit it), so the
    # gateway's writes pause after a few KiB instead of after the megabytes loopback's
    # autotuned buffer can take, however fast the stream is produced.
    for listener in served.server.servers:
        for listening in listener.sockets:
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    body = json.dumps({"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}],
                       "stream": True, "ignore_eos": True, "max_tokens": 5_000_000,
                       "logprobs": True, "top_logprobs": 20}).encode()
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
        sock.connect(("127.0.0.1", served.port))
        with sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 120
            while not servicer.cancelled_ids:  # reads nothing meanwhile
                assert time.monotonic() < deadline, (
                    f"the held stream was never cancelled ({len(servicer.requests)} verifier calls)")
                time.sleep(0.05)
            assert servicer.requests and not servicer.completed_ids
    finally:
        served.stop()
        server.close()


@pytest.mark.parametrize("fields", [{"header_timeout_s": 0}, {"body_timeout_s": -1},
                                    {"write_stall_timeout_s": 0},
                                    {"limit_concurrency": 0}, {"max_header_bytes": 10}])
def test_limits_are_validated(fields):
    with pytest.raises(ConfigError):
        ServerLimits(**fields)
