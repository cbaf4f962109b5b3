"""The gateway's HTTP server: uvicorn's h11 protocol with limits for slow or hostile clients.

uvicorn times out only an idle keep-alive connection. A client that opens a connection and
sends nothing, or one header line every few seconds, or half a body, holds its connection
(and a slot of `limit_concurrency`) for ever. `_GatewayH11Protocol` gives the request head
and the request body each a deadline, and answers a head larger than
`h11_max_incomplete_event_size` with 431 instead of uvicorn's 400 and an immediate close
(which the still-sending client sees as a connection reset).

A client that stops reading a response (a held stream) fills the connection's buffers; the
gateway's writes then wait, and the request holds its verifier sequence and KV blocks for
ever. When writing stays paused for `write_stall_timeout_s`, the connection is aborted: the
request sees the disconnect and cancels its verifier call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import error_body
from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

# After a 431, the rest of the oversized head is read and dropped for this long before the
# close, so the client reads the answer instead of a reset.
LINGER_S = 1.0


@dataclass(frozen=True)
class ServerLimits:
    """Timeouts and limits of the gateway's HTTP server (flags of `python -m gateway`)."""

    # From the connection (or the first byte of a later request) to the end of its head.
    header_timeout_s: float = 10.0
    # From the end of the head to the end of the body.
    body_timeout_s: float = 60.0
    # Idle time between two requests on one connection (uvicorn's own timeout).
    keep_alive_timeout_s: float = 5.0
    # How long a response may wait on a client that reads none of it (buffers full).
    write_stall_timeout_s: float = 60.0
    # Open connections (and running requests) beyond which a request gets 503.
    limit_concurrency: int = 1024
    # The largest request line plus headers; larger gets 431.
    max_header_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s",
                     "write_stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}", param=name)
        if self.limit_concurrency < 1:
            raise ConfigError(f"--limit-concurrency must be >= 1, got {self.limit_concurrency}",
                              param="limit_concurrency")
        if self.max_header_bytes < 1024:
            raise ConfigError("--h11-max-incomplete-event-size must be >= 1024, got "
                              f"{self.max_header_bytes}", param="h11_max_incomplete_event_size")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen-fd", type=int, default=None, metavar="FD",
        help="serve on this inherited, already listening socket instead of binding --host "
             "and --port (`specdec serve` hands over the one its start-up /health answered on)")
    defaults = ServerLimits()
    group = parser.add_argument_group("HTTP server limits")
    group.add_argument(
        "--timeout-keep-alive", type=float, default=defaults.keep_alive_timeout_s, metavar="S",
        help="close a keep-alive connection idle this long (default: %(default)s)")
    group.add_argument(
        "--timeout-request-header", type=float, default=defaults.header_timeout_s, metavar="S",
        help="close a connection whose request line and headers did not arrive within S "
             "seconds (default: %(default)s)")
    group.add_argument(
        "--timeout-request-body", type=float, default=defaults.body_timeout_s, metavar="S",
        help="close a connection whose request body did not arrive within S seconds of its "
             "headers (default: %(default)s)")
    group.add_argument(
        "--timeout-response-stall", type=float, default=defaults.write_stall_timeout_s,
        metavar="S",
        help="close a connection whose client read nothing of its response (a held stream) "
             "for S seconds; its request is cancelled (default: %(default)s)")
    group.add_argument(
        "--limit-concurrency", type=int, default=defaults.limit_concurrency, metavar="N",
        help="answer 503 while N connections or requests are open (default: %(default)s)")
    group.add_argument(
        "--h11-max-incomplete-event-size", type=int, default=defaults.max_header_bytes,
        metavar="BYTES",
        help="largest request line plus headers; larger gets 431 (default: %(default)s)")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(header_timeout_s=args.timeout_request_header,
                        body_timeout_s=args.timeout_request_body,
                        keep_alive_timeout_s=args.timeout_keep_alive,
                        write_stall_timeout_s=args.timeout_response_stall,
                        limit_concurrency=args.limit_concurrency,
                        max_header_bytes=args.h11_max_incomplete_event_size)


def uvicorn_config(app: Any, host: str, port: int, *, log_level: str = "info",
                   limits: ServerLimits | None = None) -> uvicorn.Config:
    """The uvicorn configuration the gateway runs with (also used by tests)."""
    limits = limits or ServerLimits()
    protocol = type("GatewayH11Protocol", (_GatewayH11Protocol,), {"limits": limits})
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http=protocol,
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
        limit_concurrency=limits.limit_concurrency,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_graceful_shutdown=5)


class _GatewayH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus deadlines for the request head and body, and 431."""

    limits = ServerLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        # The client state the deadline watches: h11.IDLE (head) or h11.SEND_BODY.
        self._deadline_state: object | None = None
        self._dropping_input = False
        self._write_stall: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch_client()

    def data_received(self, data: bytes) -> None:
        if self._dropping_input:  # a 431 was sent: the rest of the head is dropped
            return
        super().data_received(data)
        self._watch_client()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._cancel_write_stall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(self.limits.write_stall_timeout_s,
                                                     self._write_stalled)

    def resume_writing(self) -> None:
        self._cancel_write_stall()
        super().resume_writing()

    def _cancel_write_stall(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
        self._write_stall = None

    def _write_stalled(self) -> None:
        self._write_stall = None
        logger.info("closing a connection: its client read nothing for %.0f s",
                    self.limits.write_stall_timeout_s)
        # close() would wait to flush what the client is not reading: drop it instead.
        self.transport.abort()

    def _watch_client(self) -> None:
        """(Re)arms the deadline when the client starts a head or a body; the deadline is
        not moved by later bytes of the same head or body, so trickling does not help."""
        state = self.conn.their_state
        watched = state if state in (h11.IDLE, h11.SEND_BODY) else None
        if self.transport.is_closing() or self._dropping_input:
            watched = None
        if watched is self._deadline_state:
            return
        self._cancel_deadline()
        if watched is None:
            return
        timeout = (self.limits.header_timeout_s if watched is h11.IDLE
                   else self.limits.body_timeout_s)
        self._deadline_state = watched
        self._deadline = self.loop.call_later(timeout, self._deadline_passed, watched)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._deadline_state = None

    def _deadline_passed(self, state: object) -> None:
        self._deadline = None
        self._deadline_state = None
        if self.transport.is_closing() or self.conn.their_state is not state:
            return
        part = "head" if state is h11.IDLE else "body"
        logger.debug("closing a connection: the request %s did not arrive in time", part)
        # A request waiting for its body sees the disconnect (answered 499, logged quietly).
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a malformed request; 431 when h11 refused an oversized head."""
        buffered, _ = self.conn.trailing_data
        if len(buffered) <= self.limits.max_header_bytes:
            super().send_400_response(msg)
            return
        self._cancel_deadline()
        body = json.dumps(error_body(431, "The request line and headers are too large.",
                                     code="request_header_fields_too_large")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=431, headers=headers,
                                   reason=b"Request Header Fields Too Large"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        # Closing now, with the client's bytes unread, would send it a reset that can
        # destroy the answer in flight: finish writing, drop what comes, close a bit later.
        self._dropping_input = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
