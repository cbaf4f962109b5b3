"""OpenAI request bodies -> validated domain objects.

Every field has explicit bounds; every rejection is an `InvalidRequestError` naming the
field. A known OpenAI (or vLLM) field that specdec cannot honour is refused with a 400 naming
it when set to anything but its default, never silently ignored; truly unknown fields are
ignored (clients send many). `null` means "use the default".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.chat import parse_messages
from gateway.request_options import (
    OutputOptions,
    PromptOptions,
    boolean_field,
    parse_output_options,
    parse_prompt_options,
    type_name,
)
from gateway.structured import GrammarRequest, grammar_from_request
from gateway.tool_chat import ToolRequest, parse_tool_request
from gateway.unhonoured_fields import refuse_unhonoured_fields
from specdec.engine.sampling_params import (
    MAX_TOKEN_ID,
    PARAMETERS,
    check_min_tokens,
    check_parameter,
    check_stop_token_ids,
    logit_bias_pairs,
)
from specdec.errors import InvalidRequestError
from specdec.v1 import specdec_pb2

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# A hard bound on n; the verifier's max_num_seqs is the one that usually applies.
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class SpeculationChoice:
    """The `speculation` extension: false turns it off, an integer k caps the draft length."""

    enabled: bool
    num_speculative_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    # The sampling parameters as the wire carries them, each checked by the engine's own
    # rules (specdec.engine.sampling_params): every bounded one set (its default when the
    # request gives none), except max_tokens 0 (not given: `default_max_tokens`), and seed
    # and logprobs, set only when given. Logit-bias ids are checked against the
    # vocabulary in generation.py.
    params: specdec_pb2.SamplingParams
    stop: tuple[str, ...]
    speculation: SpeculationChoice | None
    # Choices to generate; each is its own sequence on the verifier (seed + index).
    n: int = 1
    # The output constraint (GrammarSpec); checked by the compiler in app.py, off the loop.
    grammar: GrammarRequest | None = None
    # vLLM's cache_salt: prefix-cache blocks are shared only among requests with this salt.
    cache_salt: str | None = None
    # max_tokens when the request gives none, at most the room left in the context; None:
    # the room left (vLLM's chat default; its text completions default to 16, as OpenAI's).
    default_max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str | None
    # Each {"role": ..., "content": str} (plus "name", an assistant's "tool_calls" and a
    # tool message's "tool_call_id" when given), ready for the template.
    messages: list[dict[str, Any]]
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    tools: ToolRequest = field(default_factory=ToolRequest)
    prompt_options: PromptOptions = field(default_factory=PromptOptions)
    output: OutputOptions = field(default_factory=OutputOptions)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str | None
    # Text to tokenize, or token ids as given.
    prompt: str | list[int]
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    prompt_options: PromptOptions = field(default_factory=PromptOptions)
    output: OutputOptions = field(default_factory=OutputOptions)


class _NonJsonConstant(ValueError):
    """NaN / Infinity: Python's json accepts them, JSON does not."""


def _reject_constant(name: str) -> None:
    raise _NonJsonConstant(name)


# A lone surrogate can only come from a `\uD800`-`\uDFFF` escape: strict UTF-8 has none.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def is_json_content_type(header: str | None) -> bool:
    """`application/json`, optionally with `charset=utf-8` (the only encoding read)."""
    if not header:
        return False
    media_type, *params = header.split(";")
    if media_type.strip().lower() != "application/json":
        return False
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
                "utf-8", "utf8"):
            return False
    return True


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decodes a request body: strict UTF-8, strict JSON (no NaN), an object at the top,
    valid Unicode in every string. Messages name the problem, never Python's internals."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError("The request body is not valid UTF-8.") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column "
            f"{exc.colno}).") from None
    except _NonJsonConstant as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON: {exc} is not a JSON value.") from None
    except ValueError:  # an integer past Python's int/str conversion limit (4300 digits)
        raise InvalidRequestError("The request body has a number with too many digits.") from None
    except RecursionError:
        raise InvalidRequestError("The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(text):
        _reject_lone_surrogates(body)
    return body


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _reject_lone_surrogates(body: dict[str, Any]) -> None:
    """Every string (and key) must be encodable: the tokenizer and the JSON answer fail on
    a lone surrogate. Walked without recursion: the body may nest deeply."""
    stack: list[tuple[Any, str]] = [(value, key) for key, value in body.items()]
    stack += [(key, key) for key in body]
    while stack:
        value, field = stack.pop()
        if isinstance(value, str):
            if _has_lone_surrogate(value):
                safe_field = field.encode("utf-8", "replace").decode("utf-8")
                raise InvalidRequestError(
                    f"{safe_field} holds a lone surrogate (\\ud800-\\udfff escape): text must be "
                    "valid Unicode.", safe_field)
        elif isinstance(value, dict):
            stack.extend((item, field) for item in value.values())
            stack.extend((key, field) for key in value)
        elif isinstance(value, list):
            stack.extend((item, field) for item in value)


def _integer(body: dict[str, Any], name: str, *, minimum: int,
             maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {type_name(value)}.", name)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise InvalidRequestError(f"{name} must be {bound}, got {value}.", name)
    return value


def _parameter(body: dict[str, Any], name: str, param: str | None = None) -> float | int | None:
    """The bounded sampling parameter `name` from the request field `param` (default
    `name`), checked by specdec.engine.sampling_params; None when not given."""
    value = body.get(param or name)
    return None if value is None else check_parameter(name, value, param)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError("stop must be a string or an array of strings.", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings.", "stop")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise InvalidRequestError(
            f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters.", "stop")
    return tuple(dict.fromkeys(stops))


def _speculation(body: dict[str, Any]) -> SpeculationChoice | None:
    value = body.get("speculation")
    if value is None:
        return None
    if isinstance(value, bool):
        return SpeculationChoice(enabled=value)
    if isinstance(value, int) and 0 <= value < 2**31:
        return SpeculationChoice(enabled=value > 0, num_speculative_tokens=value)
    raise InvalidRequestError(
        "speculation must be false, true, or an integer number of speculative tokens >= 0.",
        "speculation")


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Returns include_usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options must be an object.", "stream_options")
    if not stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true.",
                                  "stream_options")
    return boolean_field(options, "include_usage", False)


def _reject_unsupported(body: dict[str, Any]) -> None:
    best_of = _integer(body, "best_of", minimum=1, maximum=2**31 - 1)
    if best_of is not None and best_of != 1:
        # vLLM v1 dropped best_of too; n choices and logprobs give the same.
        raise InvalidRequestError("Only best_of=1 is supported; ask for n choices with "
                                  "logprobs and rank them instead.", "best_of")
    refuse_unhonoured_fields(body)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Chat: `logprobs` (boolean) and `top_logprobs` (0-20, needs logprobs). Completions:
    `logprobs` (0-20, the legacy integer)."""
    if not chat:
        return _parameter(body, "logprobs")  # type: ignore[return-value]
    enabled = boolean_field(body, "logprobs", False)
    top = _parameter(body, "logprobs", "top_logprobs")
    if top and not enabled:
        raise InvalidRequestError("top_logprobs needs logprobs set to true.", "top_logprobs")
    return int(top or 0) if enabled else None


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object of token id (a decimal string) -> bias, checked as the
    engine checks it."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"logit_bias must be an object mapping token ids to biases, got "
            f"{type_name(value)}.", "logit_bias")
    for key in value:
        if not (isinstance(key, str) and key.isdecimal() and int(key) <= MAX_TOKEN_ID):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}.",
                "logit_bias")
    return logit_bias_pairs([(int(key), bias) for key, bias in value.items()])


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's rule: absent, or a non-empty string."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError("cache_salt must be a non-empty string if provided.",
                                  "cache_salt")
    return salt


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError(f"model must be a string, got {type_name(model)}.", "model")
    return model


# vLLM's (and OpenAI's) max_tokens for a text completion that gives none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _wire_params(body: dict[str, Any], chat: bool) -> specdec_pb2.SamplingParams:
    """The request's sampling parameters, checked, as the wire carries them (SamplingOptions)."""
    params = specdec_pb2.SamplingParams()
    for name, parameter in PARAMETERS.items():
        if parameter.default is not None and name != "max_tokens":
            value = _parameter(body, name)
            setattr(params, name, parameter.default if value is None else value)
    # max_completion_tokens is the newer name; it wins when both are given.
    max_tokens = _parameter(body, "max_tokens", "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _parameter(body, "max_tokens")
    if max_tokens is not None:
        check_min_tokens(params.min_tokens, int(max_tokens))
        params.max_tokens = int(max_tokens)
    seed = _parameter(body, "seed")
    if seed is not None:
        # The wire carries uint64: a negative seed keeps its two's-complement bits.
        params.seed = int(seed) & (2**64 - 1)
    logprobs = _logprobs(body, chat)
    if logprobs is not None:
        params.logprobs = logprobs
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        params.stop_token_ids.extend(check_stop_token_ids(stop_token_ids))
    params.ignore_eos = boolean_field(body, "ignore_eos", False)
    params.logit_bias.update(_logit_bias(body))
    return params


def parse_sampling(body: dict[str, Any], *, chat: bool = True) -> SamplingOptions:
    _reject_unsupported(body)
    return SamplingOptions(
        params=_wire_params(body, chat),
        stop=_stop(body),
        speculation=_speculation(body),
        n=_integer(body, "n", minimum=1, maximum=MAX_CHOICES) or 1,
        grammar=grammar_from_request(body, validate=False),
        cache_salt=_cache_salt(body),
        default_max_tokens=None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS,
    )


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    model = _model(body)
    messages = parse_messages(body.get("messages"))
    stream = boolean_field(body, "stream", False)
    sampling = parse_sampling(body)
    return ChatRequest(model=model, messages=messages, sampling=sampling,
                       stream=stream, include_usage=_stream_options(body, stream),
                       tools=parse_tool_request(body),
                       prompt_options=parse_prompt_options(body, chat=True),
                       output=parse_output_options(body, logprobs=sampling.params.HasField("logprobs")))


def _prompt(value: Any) -> str | list[int]:
    # A batch of one is accepted; batches of several prompts are not supported (ask n choices
    # of one prompt instead).
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("prompt must not be empty.", "prompt")
        return value
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 or t >= 2**32 for t in value):
            raise InvalidRequestError("prompt token ids must be non-negative.", "prompt")
        return value
    if value is None:
        raise InvalidRequestError("prompt is required.", "prompt")
    raise InvalidRequestError(
        "prompt must be a non-empty string or a non-empty array of token ids "
        "(batches of more than one prompt are not supported).", "prompt")


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    model = _model(body)
    prompt = _prompt(body.get("prompt"))
    if body.get("suffix") is not None:
        raise InvalidRequestError("suffix is not supported.", "suffix")
    # Tool calls belong to chat (OpenAI's completions have none).
    if body.get("tools") not in (None, []):
        raise InvalidRequestError("tools is only supported by /v1/chat/completions.", "tools")
    if body.get("tool_choice") not in (None, "none"):
        raise InvalidRequestError("tool_choice is only supported by /v1/chat/completions.",
                                  "tool_choice")
    stream = boolean_field(body, "stream", False)
    sampling = parse_sampling(body, chat=False)
    return CompletionRequest(model=model, prompt=prompt, sampling=sampling,
                             stream=stream, include_usage=_stream_options(body, stream),
                             prompt_options=parse_prompt_options(body, chat=False),
                             output=parse_output_options(
                                 body, logprobs=sampling.params.HasField("logprobs")))
