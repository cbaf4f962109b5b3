"""The one place that turns errors into OpenAI error JSON and HTTP status codes.

Domain code raises `specdec.errors` types; gRPC failures from the verifier are first turned
into those types by `error_from_grpc`, then every error leaves through `error_response`.
Never send a traceback to a client: unexpected exceptions become a generic 500.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import grpc
from starlette.responses import JSONResponse

from specdec.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    SpecdecError,
    UnavailableError,
)
from specdec.rpc.grpc_status import error_param

logger = logging.getLogger(__name__)

# HTTP status -> OpenAI error "type".
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}

_GRPC_TO_ERROR: dict[grpc.StatusCode, type[SpecdecError]] = {
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
    grpc.StatusCode.CANCELLED: UnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
}
# The gateway checked the model and the request already: with these the verifier's text
# describes its own set-up, not the request, and the client gets the generic 500.
_VERIFIER_SETUP_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)

GENERIC_SERVER_MESSAGE = "The server had an error while processing your request."
# gRPC details name internal addresses ("ipv4:10.0.0.5:50051: Connection refused"): they go
# to the log, and the client gets these fixed texts.
UNAVAILABLE_MESSAGE = "The model server is unavailable; retry later."
OVERLOADED_MESSAGE = "The model server is overloaded; retry later."


class ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error can quote a client's text, which may hold a
    lone surrogate that UTF-8 cannot encode; escaped, it still renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                     else "server_error"),
            "param": param,
            "code": code,
        }
    }


def status_for(exc: SpecdecError) -> tuple[int, str | None]:
    """HTTP status and OpenAI error code for a domain error."""
    if isinstance(exc, RequestTooLargeError):
        return 413, "request_too_large"
    if isinstance(exc, UnsupportedMediaTypeError):
        return 415, "unsupported_media_type"
    if isinstance(exc, InvalidRequestError):
        return 400, None
    if isinstance(exc, ModelNotFoundError):
        return 404, "model_not_found"
    if isinstance(exc, OverloadedError):
        return 429, "overloaded"
    if isinstance(exc, UnavailableError):
        return 503, "service_unavailable"
    return 500, "internal_error"


def error_payload(exc: BaseException) -> tuple[int, dict]:
    """Status and body for any exception; unexpected ones are logged, never described."""
    if isinstance(exc, SpecdecError):
        status, code = status_for(exc)
        if status == 500:
            logger.error("request failed: %s", exc.message)
            return status, error_body(status, GENERIC_SERVER_MESSAGE, None, code)
        return status, error_body(status, exc.message, exc.param, code)
    logger.error("unexpected error while serving a request", exc_info=exc)
    return 500, error_body(500, GENERIC_SERVER_MESSAGE, None, "internal_error")


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_payload(exc)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return ErrorJSONResponse(body, status_code=status, headers=headers)


def plain_error_response(status: int, message: str, param: str | None = None,
                         code: str | None = None,
                         headers: Mapping[str, str] | None = None) -> JSONResponse:
    return ErrorJSONResponse(error_body(status, message, param, code), status_code=status,
                             headers=headers)


def error_from_grpc(err: grpc.aio.AioRpcError) -> SpecdecError:
    """Maps a verifier's gRPC status to the domain error the gateway answers with."""
    code = err.code()
    error_type = _GRPC_TO_ERROR.get(code, SpecdecError)
    details, param = error_param(err)
    if error_type is UnavailableError:
        logger.info("verifier call failed: %s: %s", code.name, details)
        return UnavailableError(UNAVAILABLE_MESSAGE)
    if error_type is OverloadedError:
        logger.info("verifier call failed: %s: %s", code.name, details)
        return OverloadedError(OVERLOADED_MESSAGE)
    if code in _VERIFIER_SETUP_CODES:
        logger.warning("verifier refused a request: %s: %s", code.name, details)
        return SpecdecError(f"verifier error {code.name}: {details}")
    if error_type is SpecdecError:
        # Kept for the log line only; clients get the generic message.
        return SpecdecError(f"verifier error {code.name}: {details}")
    # INVALID_ARGUMENT / OUT_OF_RANGE: the verifier's own validation text, about the request.
    return error_type(details, param=param)


class RequestTooLargeError(InvalidRequestError):
    """The request body exceeds the gateway's limit (HTTP 413)."""


class UnsupportedMediaTypeError(InvalidRequestError):
    """The request body is not declared `application/json` (HTTP 415)."""
