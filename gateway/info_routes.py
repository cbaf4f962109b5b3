"""The gateway's routes that generate nothing: the served model (`/v1/models`,
`/v1/models/{id}`), health (`/health`, `/ping`), metrics, the version, and vLLM's
`/tokenize` / `/detokenize`."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import responses
from gateway.chat import parse_messages, render_chat_prompt, tokenize_prompt
from gateway.http_io import check_model, openai_errors, read_json
from gateway.request_options import boolean_field, parse_prompt_options
from gateway.tool_chat import template_messages
from specdec.errors import InvalidRequestError

MAX_DETOKENIZE_TOKENS = 1 << 20


def _model_card(request: Request) -> dict[str, Any]:
    state = request.app.state
    # `root` is the served name too: the model's path is the operator's business.
    return responses.model_list(state.config.model_name, state.config.model_name,
                                state.created, _max_model_len(request))["data"][0]


@openai_errors
async def retrieve_model(request: Request) -> Response:
    """`/v1/models/{id}`: the served model's card, or OpenAI's 404 for another id."""
    model_id = request.path_params["model_id"]
    check_model(request, model_id)  # OpenAI's 404 naming another model
    return JSONResponse(_model_card(request))


async def ping(request: Request) -> Response:
    """vLLM's `/ping` (SageMaker's health route): /health's status with no body."""
    return Response(status_code=200 if request.app.state.verifier.serving else 503)


async def version(request: Request) -> Response:
    return JSONResponse({"version": metadata.version("specdec")})


def _max_model_len(request: Request) -> int | None:
    state = request.app.state
    info = state.verifier.cached_info
    return state.config.max_model_len or (info.max_model_len if info else None)


def _token_ids(request: Request, body: dict[str, Any]) -> list[int]:
    """The prompt of a /tokenize request, tokenized as the generating routes would: a chat
    form (`messages` and the template's switches) or a completion form (`prompt`)."""
    tokenizer = request.app.state.tokenizer
    if body.get("tools"):
        raise InvalidRequestError("tools is not supported by /tokenize.", "tools")
    if "messages" in body:
        messages = template_messages(parse_messages(body["messages"]),
                                     request.app.state.tool_settings.template_accepts_tools)
        return render_chat_prompt(tokenizer, messages, None,
                                  parse_prompt_options(body, chat=True))
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequestError("prompt must be a non-empty string (or give messages).",
                                  "prompt")
    return tokenize_prompt(tokenizer, prompt,
                           parse_prompt_options(body, chat=False).add_special_tokens)


@openai_errors
async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: {count, max_model_len, tokens, token_strs}."""
    body = await read_json(request)
    check_model(request, body.get("model"))
    return_token_strs = boolean_field(body, "return_token_strs", False)
    token_ids = await run_in_threadpool(_token_ids, request, body)
    token_strs = (request.app.state.tokenizer.convert_ids_to_tokens(token_ids)
                  if return_token_strs else None)
    return JSONResponse({"count": len(token_ids), "max_model_len": _max_model_len(request),
                         "tokens": token_ids, "token_strs": token_strs})


@openai_errors
async def detokenize(request: Request) -> Response:
    """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
    body = await read_json(request)
    check_model(request, body.get("model"))
    tokenizer = request.app.state.tokenizer
    tokens = body.get("tokens")
    vocab_size = len(tokenizer)
    if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE_TOKENS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
            for t in tokens):
        raise InvalidRequestError(
            f"tokens must be an array of at most {MAX_DETOKENIZE_TOKENS} token ids below the "
            f"vocabulary size {vocab_size}.", "tokens")
    text = await run_in_threadpool(tokenizer.decode, tokens)
    return JSONResponse({"prompt": text})
