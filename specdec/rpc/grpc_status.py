"""The one place that maps specdec's errors to gRPC status codes."""

from __future__ import annotations

import grpc

from specdec.errors import (
    ConfigError,
    DrafterMismatchError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    SpecdecError,
    UnavailableError,
)

_STATUS_BY_ERROR: tuple[tuple[type[SpecdecError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (DrafterMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_for(error: SpecdecError) -> grpc.StatusCode:
    for error_type, code in _STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def error_details(error: SpecdecError) -> str:
    """The message sent to the client: the error's text and, when known, its field."""
    if error.param:
        return f"{error.message} (param: {error.param})"
    return error.message
