"""The gateway's HTTP plumbing shared by its routes: OpenAI error JSON for every failure,
the JSON body reader, the model name check, and server-sent events (chat and completion
chunks as `data:` lines; the Responses API's as `event:` / `data:` pairs)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from gateway.choices import Choice, close_choices
from gateway.errors import (
    RequestTooLargeError,
    UnsupportedMediaTypeError,
    error_payload,
    error_response,
)
from gateway.protocol import is_json_content_type, parse_json_body
from specdec.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]

# nginx's "client closed request": counted apart from the server's own failures.
CLIENT_CLOSED_REQUEST = 499
# An unknown model name is quoted back in the 404, at most this long.
MAX_QUOTED_MODEL_CHARS = 256

def openai_errors(handler: Handler) -> Handler:
    """Every failure of an endpoint leaves as OpenAI error JSON, never as a traceback."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientDisconnect:
            # The client left while sending its body: nothing to answer and nothing wrong
            # with the server, so no traceback (the server's request timeouts end here too).
            logger.debug("client disconnected before sending the whole request body")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            return error_response(exc)

    return wrapped


async def read_json(request: Request) -> dict[str, Any]:
    # Only JSON: a browser sends text/plain and form bodies cross-site without a CORS
    # preflight, so parsing those would let any web page use an open gateway.
    if not is_json_content_type(request.headers.get("content-type")):
        raise UnsupportedMediaTypeError(
            "The request body must be JSON, sent with 'Content-Type: application/json'.")
    limit = request.app.state.config.max_request_bytes
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestTooLargeError(f"The request body is larger than {limit} bytes.")
    return parse_json_body(bytes(body))


def check_model(request: Request, model: str | None) -> None:
    if model is not None and not request.app.state.config.names_model(model):
        quoted = model if len(model) <= MAX_QUOTED_MODEL_CHARS else (
            model[:MAX_QUOTED_MODEL_CHARS] + "...")
        raise ModelNotFoundError(f"The model `{quoted}` does not exist.", "model")


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def sse(chunks: AsyncGenerator[dict, None], choices: list[Choice],
               on_finish: Callable[[], None]) -> AsyncIterator[str]:
    """`data: {chunk}` events then `data: [DONE]`.

    A client that leaves is seen by starlette's StreamingResponse, which listens for the
    disconnect beside the stream and cancels it (this generator's cleanup then cancels the
    verifier calls). Asking `request.is_disconnected()` after every chunk as well (a receive
    under a cancel scope each time) was the largest piece of the gateway's event loop in a
    py-spy profile at sixteen streams; without it the gateway's CPU time over one `bench
    serve` run (48 prompts, c = 16) went from 153-186 to 112-168 ticks (mean -18%), CPU the
    verifier's forward shares on a small machine."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent: the error travels as an event
        _, body = error_payload(exc)
        yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()
        await close_choices(choices)  # cancels the verifier calls that still run
        on_finish()


async def named_sse(events: AsyncGenerator[dict, None], choices: list[Choice],
                     on_finish: Callable[[], None]) -> AsyncIterator[str]:
    """The Responses API's `event: <type>` / `data: {event}` pairs (no [DONE]); an error
    after the stream started arrives as an `error` event."""
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    except Exception as exc:  # headers are sent: the error travels as an event
        _, body = error_payload(exc)
        yield f"event: error\ndata: {json.dumps({'type': 'error', **body['error']})}\n\n"
    finally:
        await events.aclose()
        await close_choices(choices)
        on_finish()


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
