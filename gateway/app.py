"""The gateway's Starlette app: routes, lifespan, API key check, SSE.

All state lives on `app.state`, set up in the lifespan: config, tokenizer, verifier
client, metrics. `create_app` takes the tokenizer (and optionally a verifier client) so
tests inject small ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import responses
from gateway.chat import max_chars_per_token, render_chat_prompt, tokenize_prompt
from gateway.choices import (
    Choice,
    close_choices,
    collect_until_disconnect,
    open_choices,
)
from gateway.errors import (
    RequestTooLargeError,
    UnsupportedMediaTypeError,
    error_payload,
    error_response,
    plain_error_response,
)
from gateway.generation import build_generate_request, choice_requests
from gateway.logprobs import TokenTexts
from gateway.spec_decode_metrics import check_mode as check_spec_decode_metrics_mode
from gateway.metrics import GatewayMetrics, RequestCountMiddleware
from gateway.protocol import (
    SamplingOptions,
    is_json_content_type,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from gateway.tool_chat import ToolOutput, ToolSettings, plan_tools, template_messages
from gateway.tools import TOOL_CALL_PARSERS, template_accepts_tools
from gateway.verifier_client import VerifierClient
from specdec.errors import ConfigError, ModelNotFoundError
from specdec.grammar_checker import GrammarChecker, GrammarLimits

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]

# nginx's "client closed request": counted apart from the server's own failures.
CLIENT_CLOSED_REQUEST = 499
# An unknown model name is quoted back in the 404, at most this long.
MAX_QUOTED_MODEL_CHARS = 256
@dataclass(frozen=True)
class GatewayConfig:
    """Validated start-up configuration of one gateway."""

    model: str
    verifier_addresses: tuple[str, ...] = ()
    # Defaults to `model` as given (vLLM).
    served_model_name: str | None = None
    # Defaults to the verifier's (GetInfo).
    max_model_len: int | None = None
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 18080
    max_request_bytes: int = 32 * 1024 * 1024
    # vLLM's flags: tool_choice "auto" needs both (and a chat template that renders tools).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's per-request speculative metrics in responses (gateway.spec_decode_metrics).
    per_request_spec_decode_metrics: str = "none"
    # What one structured-output constraint may cost (specdec.grammar_checker).
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)

    def __post_init__(self) -> None:
        check_spec_decode_metrics_mode(self.per_request_spec_decode_metrics)
        if not self.model:
            raise ConfigError("--model must not be empty", param="model")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}", param="tool_call_parser")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser",
                              param="tool_call_parser")
        object.__setattr__(self, "verifier_addresses", tuple(self.verifier_addresses))
        for address in self.verifier_addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--verifier must be host:port, got {address!r}",
                                  param="verifier")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}",
                              param="max_model_len")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty", param="api_key")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}", param="port")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class ApiKeyMiddleware:
    """Bearer-token check on /v1/*; /health and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self._api_key is not None and scope["type"] == "http"
                and scope["path"].startswith("/v1/")):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode(), self._api_key):
                response = plain_error_response(
                    401, "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _openai_errors(handler: Handler) -> Handler:
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


async def _read_json(request: Request) -> dict[str, Any]:
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


def _check_model(request: Request, model: str | None) -> None:
    served = request.app.state.config.model_name
    if model is not None and model != served:
        quoted = model if len(model) <= MAX_QUOTED_MODEL_CHARS else (
            model[:MAX_QUOTED_MODEL_CHARS] + "...")
        raise ModelNotFoundError(f"The model `{quoted}` does not exist.", "model")


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(chunks: AsyncIterator[dict], choices: list[Choice],
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


async def _check_grammar(request: Request, sampling: SamplingOptions) -> None:
    """A constraint the compiler rejects is a 400 naming its field, before anything is
    queued; checked in the grammar checker's processes, under its time budget (never in
    the thread pool chat templating uses), and abandoned when the client leaves."""
    grammar = sampling.grammar
    if grammar is None:
        return
    check = asyncio.ensure_future(request.app.state.grammar_checker.check(
        grammar.kind, grammar.value, param=grammar.param))
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({check, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not check.done():
            check.cancel()  # kills its worker
    if not check.done() or check.cancelled():
        raise ClientDisconnect()
    check.result()


async def _generate(request: Request, prompt_token_ids: list[int], sampling: SamplingOptions,
                    *, chat: bool, stream: bool, include_usage: bool, started_at: float,
                    prompt_param: str,
                    tool_output: Callable[[], ToolOutput | None] | None = None) -> Response:
    state = request.app.state
    info = await state.verifier.get_info()
    max_model_len = state.config.max_model_len or info.max_model_len
    generate_request = build_generate_request(prompt_token_ids, sampling, info, max_model_len,
                                              prompt_param)
    choices = await open_choices(state.verifier, choice_requests(generate_request, sampling.n),
                                 state.tokenizer, prompt_token_ids, sampling.stop, started_at,
                                 sampling.min_tokens)
    output = responses.Output(responses.new_id("chatcmpl" if chat else "cmpl"), responses.now(),
                              state.config.model_name, chat,
                              state.token_texts if sampling.logprobs is not None else None,
                              tool_output,
                              spec_decode_metrics=state.config.per_request_spec_decode_metrics,
                              num_speculative_tokens=info.num_speculative_tokens)

    def observe() -> None:
        for choice in choices:
            state.metrics.observe_generation(choice.result)

    if not stream:
        collected = await collect_until_disconnect(
            choices, functools.partial(_wait_for_disconnect, request))
        observe()
        if collected is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(responses.response_body(output, collected))
    make_chunks = responses.chat_chunks if chat else responses.completion_chunks
    chunks = make_chunks(output, choices, include_usage)
    return StreamingResponse(_sse(chunks, choices, observe),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@_openai_errors
async def chat_completions(request: Request) -> Response:
    started_at = time.monotonic()
    chat = parse_chat_request(await _read_json(request))
    _check_model(request, chat.model)
    settings: ToolSettings = request.app.state.tool_settings
    plan = plan_tools(chat.tools, chat.sampling.grammar, settings)
    sampling = chat.sampling
    if plan.grammar is not None:
        sampling = dataclasses.replace(sampling, grammar=plan.grammar)
    await _check_grammar(request, sampling)
    messages = template_messages(chat.messages, settings.template_accepts_tools)
    state = request.app.state
    max_model_len = state.config.max_model_len or (await state.verifier.get_info()).max_model_len
    prompt_token_ids = await run_in_threadpool(functools.partial(
        render_chat_prompt, state.tokenizer, messages, plan.template_tools,
        max_model_len=max_model_len, chars_per_token=state.chars_per_token))
    return await _generate(request, prompt_token_ids, sampling, chat=True,
                           stream=chat.stream, include_usage=chat.include_usage,
                           started_at=started_at, prompt_param="messages",
                           tool_output=plan.new_output)


@_openai_errors
async def completions(request: Request) -> Response:
    started_at = time.monotonic()
    completion = parse_completion_request(await _read_json(request))
    _check_model(request, completion.model)
    await _check_grammar(request, completion.sampling)
    prompt_token_ids = await run_in_threadpool(tokenize_prompt, request.app.state.tokenizer,
                                               completion.prompt)
    return await _generate(request, prompt_token_ids, completion.sampling, chat=False,
                           stream=completion.stream, include_usage=completion.include_usage,
                           started_at=started_at, prompt_param="prompt")


@_openai_errors
async def list_models(request: Request) -> Response:
    state = request.app.state
    info = state.verifier.cached_info
    max_model_len = state.config.max_model_len or (info.max_model_len if info else None)
    # `root` is the served name too: the model's path is the operator's business.
    return JSONResponse(responses.model_list(state.config.model_name, state.config.model_name,
                                             state.created, max_model_len))


async def health(request: Request) -> Response:
    """From the state the verifier client's background probes keep: a flood of health
    checks costs the verifiers nothing. Names no address or path (it is unauthenticated)."""
    verifier = request.app.state.verifier
    serving = verifier.serving
    # Which verifier is down or not started (unreachable), starting ("starting: <phase>"),
    # draining (not_serving) or serving another tokenizer (tokenizer_mismatch).
    status = "ok" if serving else "starting" if verifier.starting else "unavailable"
    body = {"status": status, "verifiers": verifier.statuses(), "problems": verifier.problems(),
            "deterministic": verifier.deterministic}
    return JSONResponse(body, status_code=200 if serving else 503)


async def metrics(request: Request) -> Response:
    return await request.app.state.metrics.endpoint(request)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return plain_error_response(exc.status_code, str(exc.detail), headers=exc.headers)


async def _unhandled_exception(request: Request, exc: Exception) -> Response:
    return error_response(exc)


def _fingerprint(tokenizer: Any) -> str | None:
    """The tokenizer's fingerprint as the verifier computes it; None: not checked."""
    # Imported here: the model-files module pulls in the model code (torch).
    from specdec.models.model_files import tokenizer_fingerprint

    try:
        return tokenizer_fingerprint(tokenizer)
    except Exception as exc:  # a tokenizer without a vocabulary to hash
        logger.warning("cannot fingerprint the tokenizer (%s: %s): the verifiers' tokenizers "
                       "are not checked", type(exc).__name__, exc)
        return None


def create_app(config: GatewayConfig, tokenizer: Any,
               verifier_client: VerifierClient | None = None) -> Starlette:
    """The gateway app. It owns `verifier_client` (started and closed in the lifespan)."""
    if verifier_client is None and not config.verifier_addresses:
        raise ConfigError("at least one --verifier host:port is needed", param="verifier")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        client = verifier_client or VerifierClient(config.verifier_addresses)
        client.expect_tokenizer(await run_in_threadpool(_fingerprint, tokenizer))
        app.state.tool_settings = ToolSettings(
            config.enable_auto_tool_choice, config.tool_call_parser,
            await run_in_threadpool(template_accepts_tools, tokenizer))
        await client.start()
        app.state.config = config
        app.state.tokenizer = tokenizer
        app.state.token_texts = TokenTexts(tokenizer)
        app.state.chars_per_token = await run_in_threadpool(max_chars_per_token, tokenizer)
        app.state.verifier = client
        app.state.metrics = GatewayMetrics(config.model_name)
        app.state.created = responses.now()
        app.state.grammar_checker = GrammarChecker(config.grammar_limits)
        logger.info("gateway serving model %r (tokenizer %s) via verifiers %s",
                    config.model_name, config.model, ", ".join(client.addresses))
        try:
            yield
        finally:
            await app.state.grammar_checker.close()
            await client.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    middleware = [
        Middleware(RequestCountMiddleware),
        Middleware(ApiKeyMiddleware, api_key=config.api_key),
    ]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers={HTTPException: _http_exception,
                                         Exception: _unhandled_exception})
