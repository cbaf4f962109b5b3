"""The gateway's Starlette app: the generating routes, lifespan, API key check.

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
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import info_routes, responses, responses_api
from gateway.chat import max_chars_per_token, render_chat_prompt, tokenize_prompt
from gateway.config import GatewayConfig
from gateway.choices import Choice, collect_until_disconnect, open_choices
from gateway.errors import error_response, plain_error_response
from gateway.http_io import (
    CLIENT_CLOSED_REQUEST,
    check_model,
    event_stream,
    named_sse,
    openai_errors,
    read_json,
    sse,
    wait_for_disconnect,
)
from gateway.generation import build_generate_request, choice_requests
from gateway.logprobs import TokenTexts
from gateway.metrics import GatewayMetrics, RequestCountMiddleware
from gateway.protocol import (
    ChatRequest,
    SamplingOptions,
    parse_chat_request,
    parse_completion_request,
)
from gateway.request_options import OutputOptions, PromptOptions, boolean_field, truncate_prompt
from gateway.tool_chat import ToolOutput, ToolSettings, plan_tools, template_messages
from gateway.tools import template_accepts_tools
from gateway.verifier_client import VerifierClient
from specdec.errors import ConfigError, InvalidRequestError
from specdec.grammar_checker import GrammarChecker

logger = logging.getLogger(__name__)


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


async def _check_grammar(request: Request, sampling: SamplingOptions) -> None:
    """A constraint the compiler rejects is a 400 naming its field, before anything is
    queued; checked in the grammar checker's processes, under its time budget (never in
    the thread pool chat templating uses), and abandoned when the client leaves."""
    grammar = sampling.grammar
    if grammar is None:
        return
    check = asyncio.ensure_future(request.app.state.grammar_checker.check(
        grammar.kind, grammar.value, param=grammar.param))
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({check, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not check.done():
            check.cancel()  # kills its worker
    if not check.done() or check.cancelled():
        raise ClientDisconnect()
    check.result()


async def _open_generation(request: Request, prompt_token_ids: list[int],
                           sampling: SamplingOptions, *, chat: bool, started_at: float,
                           prompt_param: str, prompt_options: PromptOptions,
                           output_options: OutputOptions,
                           echo_text: Callable[[list[int]], str] | None = None,
                           tool_output: Callable[[], ToolOutput | None] | None = None,
                           ) -> tuple[responses.Output, list[Choice]]:
    """Starts the choices' verifier calls. `echo_text` gives the text every choice starts
    with, from the (truncated) prompt."""
    state = request.app.state
    info = await state.verifier.get_info()
    max_model_len = state.config.max_model_len or info.max_model_len
    prompt_token_ids = truncate_prompt(prompt_token_ids, prompt_options, max_model_len)
    generate_request = build_generate_request(
        prompt_token_ids, sampling, info, max_model_len, prompt_param,
        record_steps=state.config.per_request_spec_decode_metrics == "detailed")
    echoed = echo_text(prompt_token_ids) if echo_text is not None else ""
    try:
        choices = await open_choices(state.verifier, choice_requests(generate_request, sampling.n),
                                     state.tokenizer, prompt_token_ids, sampling.stop, started_at,
                                     sampling.params.min_tokens, output_options)
    except InvalidRequestError as error:
        grammar = sampling.grammar
        if grammar is None or error.param != "grammar":
            raise
        # The verifier knows a GrammarSpec only (its probe, its compile budget): the client
        # is told the field it sent the constraint in.
        error.param = grammar.param
        raise
    prefix = "chatcmpl" if chat else "cmpl"
    response_id = (f"{prefix}-{output_options.request_id}" if output_options.request_id
                   else responses.new_id(prefix))
    output = responses.Output(response_id, responses.now(), state.config.model_name, chat,
                              state.token_texts if sampling.params.HasField("logprobs") else None,
                              tool_output,
                              spec_decode_metrics=state.config.per_request_spec_decode_metrics,
                              num_speculative_tokens=info.num_speculative_tokens,
                              echo_text=echoed,
                              prompt_token_ids=(prompt_token_ids
                                                if output_options.return_token_ids else None))
    return output, choices


def _observer(request: Request, choices: list[Choice]) -> Callable[[], None]:
    def observe() -> None:
        for choice in choices:
            request.app.state.metrics.observe_generation(choice.result)

    return observe


async def _collect(request: Request, output: responses.Output,
                   choices: list[Choice]) -> dict | None:
    """The whole answer; None if the client left first."""
    collected = await collect_until_disconnect(
        choices, functools.partial(wait_for_disconnect, request))
    _observer(request, choices)()
    return None if collected is None else responses.response_body(output, collected)


async def _answer(request: Request, output: responses.Output, choices: list[Choice], *,
                  stream: bool, include_usage: bool) -> Response:
    if not stream:
        body = await _collect(request, output, choices)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(body)
    make_chunks = responses.chat_chunks if output.chat else responses.completion_chunks
    chunks = make_chunks(output, choices, include_usage)
    return event_stream(sse(chunks, choices, _observer(request, choices)))


async def _open_chat(request: Request, chat: ChatRequest,
                     started_at: float) -> tuple[responses.Output, list[Choice]]:
    settings: ToolSettings = request.app.state.tool_settings
    plan = plan_tools(chat.tools, chat.sampling.grammar, settings)
    sampling = chat.sampling
    if plan.grammar is not None:
        sampling = dataclasses.replace(sampling, grammar=plan.grammar)
    await _check_grammar(request, sampling)
    messages = plan.prompt_messages(
        template_messages(chat.messages, settings.template_accepts_tools))
    state = request.app.state
    max_model_len = state.config.max_model_len or (await state.verifier.get_info()).max_model_len
    prompt_token_ids = await run_in_threadpool(functools.partial(
        render_chat_prompt, state.tokenizer, messages, plan.template_tools, chat.prompt_options,
        max_model_len=max_model_len, chars_per_token=state.chars_per_token))
    return await _open_generation(
        request, prompt_token_ids, sampling, chat=True, started_at=started_at,
        prompt_param="messages", prompt_options=chat.prompt_options,
        output_options=chat.output,
        echo_text=functools.partial(_chat_echo, chat.messages) if chat.output.echo else None,
        tool_output=plan.new_output)


@openai_errors
async def chat_completions(request: Request) -> Response:
    started_at = time.monotonic()
    chat = parse_chat_request(await read_json(request))
    check_model(request, chat.model)
    output, choices = await _open_chat(request, chat, started_at)
    return await _answer(request, output, choices, stream=chat.stream,
                         include_usage=chat.include_usage)


@openai_errors
async def create_response(request: Request) -> Response:
    """/v1/responses: the Responses API over the chat pipeline (gateway/responses_api.py)."""
    started_at = time.monotonic()
    body = await read_json(request)
    stream = boolean_field(body, "stream", False)
    chat = parse_chat_request(responses_api.chat_body(body))
    check_model(request, chat.model)
    output, choices = await _open_chat(request, chat, started_at)
    shell = responses_api.ResponseShell(body, request.app.state.config.model_name)
    if not stream:
        completion = await _collect(request, output, choices)
        if completion is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(responses_api.response_object(shell, completion))
    events = responses_api.response_events(shell, responses.chat_chunks(output, choices, True))
    return event_stream(named_sse(events, choices, _observer(request, choices)))


@openai_errors
async def completions(request: Request) -> Response:
    started_at = time.monotonic()
    completion = parse_completion_request(await read_json(request))
    check_model(request, completion.model)
    await _check_grammar(request, completion.sampling)
    tokenizer = request.app.state.tokenizer
    prompt_token_ids = await run_in_threadpool(tokenize_prompt, tokenizer, completion.prompt,
                                               completion.prompt_options.add_special_tokens)
    echo_text = None
    if completion.output.echo:
        echo_text = functools.partial(_completion_echo, tokenizer, completion.prompt,
                                      len(prompt_token_ids))
    output, choices = await _open_generation(
        request, prompt_token_ids, completion.sampling, chat=False, started_at=started_at,
        prompt_param="prompt", prompt_options=completion.prompt_options,
        output_options=completion.output, echo_text=echo_text)
    return await _answer(request, output, choices, stream=completion.stream,
                         include_usage=completion.include_usage)


def _chat_echo(messages: list[dict[str, Any]], prompt_token_ids: list[int]) -> str:
    """vLLM's chat echo: the last message's content when it is the assistant's (the answer
    continues it), else nothing."""
    last = messages[-1]
    return last["content"] if last["role"] == "assistant" else ""


def _completion_echo(tokenizer: Any, prompt: str | list[int], num_prompt_tokens: int,
                     prompt_token_ids: list[int]) -> str:
    """The prompt as the client sent it, or decoded from its (truncated) ids."""
    if isinstance(prompt, str) and len(prompt_token_ids) == num_prompt_tokens:
        return prompt
    return tokenizer.decode(prompt_token_ids, skip_special_tokens=True)


@openai_errors
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
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", info_routes.retrieve_model, methods=["GET"]),
        Route("/tokenize", info_routes.tokenize, methods=["POST"]),
        Route("/detokenize", info_routes.detokenize, methods=["POST"]),
        Route("/version", info_routes.version, methods=["GET"]),
        Route("/ping", info_routes.ping, methods=["GET", "POST"]),
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
