"""Malformed request bytes get INVALID_ARGUMENT with a message, not UNKNOWN.

gRPC Python turns a request that fails to parse into UNKNOWN with the parser's
exception text. This interceptor makes the request deserializer return a marker
instead of raising, and the wrapped handler answers INVALID_ARGUMENT naming the method;
a bidi stream is ended at its first malformed message. Nothing else is touched, so one
bad client never costs another request.

A streaming handler is either an async generator (it yields its responses) or a coroutine
that writes them with `context.write` (grpc_health's `Watch`); gRPC tells the two apart by
the function's kind, so each is wrapped by a function of the same kind.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as error:
            return _Malformed(error)
    return deserialize


async def _refuse(context: grpc.aio.ServicerContext, method: str, request: _Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"malformed request to {method}: {request.error}")


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method
        deserialize = _tolerant(handler.request_deserializer)
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await _refuse(context, method, request)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, serialize)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _checked_unary_stream(handler.unary_stream, method), deserialize, serialize)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _checked_stream_stream(handler.stream_stream, method), deserialize, serialize)
        return handler


def _checked_unary_stream(streaming: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(streaming):
        async def writes(request: Any, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, _Malformed):
                await _refuse(context, method, request)
            await streaming(request, context)

        return writes

    async def yields(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Malformed):
            await _refuse(context, method, request)
        async for response in streaming(request, context):
            yield response

    return yields


def _checked_stream_stream(bidi: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                      ) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Malformed):
                await _refuse(context, method, request)
            yield request

    if inspect.iscoroutinefunction(bidi):
        async def writes(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
            await bidi(checked(requests, context), context)

        return writes

    async def yields(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                     ) -> AsyncIterator[Any]:
        async for response in bidi(checked(requests, context), context):
            yield response

    return yields
