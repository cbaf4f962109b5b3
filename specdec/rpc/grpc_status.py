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


# Trailing metadata naming the request field an error is about (absent: none), so that a
# client (the gateway) can answer with it, as OpenAI's error JSON's `param`.
PARAM_METADATA_KEY = "specdec-param"


def error_details(error: SpecdecError) -> str:
    """The message sent to the client: the error's text and, when known, its field."""
    if error.param:
        return f"{error.message} (param: {error.param})"
    return error.message


async def abort_with(context: grpc.aio.ServicerContext, error: SpecdecError) -> None:
    """Ends the call with `error`'s status, its message and, in the trailing metadata, the
    field it is about."""
    metadata = ((PARAM_METADATA_KEY, error.param),) if error.param else ()
    await context.abort(status_for(error), error_details(error), trailing_metadata=metadata)


def error_param(err: grpc.aio.AioRpcError) -> tuple[str, str | None]:
    """A failed call's message and the field it is about (from `abort_with`'s metadata),
    the message without the field's suffix."""
    details = err.details() or err.code().name
    param = next((str(value) for key, value in (err.trailing_metadata() or ())
                  if key == PARAM_METADATA_KEY), None)
    if param is not None:
        details = details.removesuffix(f" (param: {param})")
    return details, param
