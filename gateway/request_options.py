"""vLLM's request fields that shape the prompt and the returned text rather than sampling:
how the chat template is applied, how the prompt is tokenized and truncated, and what the
answer carries besides the text (echo, token ids, stop strings, special tokens).

Parsed here for both completion routes; every one is honoured (gateway/chat.py,
gateway/generation.py, gateway/responses.py), with vLLM's defaults.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import InvalidRequestError

# vLLM's bound on a client's request_id (the response id is built from it).
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
TRUNCATION_SIDES = ("left", "right")


@dataclass(frozen=True, slots=True)
class PromptOptions:
    """How the prompt is built: the chat template's switches, special tokens, truncation."""

    add_generation_prompt: bool = True
    # The last message is left open for the model to continue (needs add_generation_prompt
    # false, as in vLLM and transformers).
    continue_final_message: bool = False
    add_special_tokens: bool = False
    # Keep only this many prompt tokens (-1: the context length); None keeps them all.
    truncate_prompt_tokens: int | None = None
    # "left" drops the oldest tokens (keeps the last N), "right" keeps the first N.
    truncation_side: str = "left"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    documents: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """What a choice's text and the response carry besides the generated text."""

    # Completions: the prompt's text before the output; chat: the last message's content
    # before the output when that message is the assistant's.
    echo: bool = False
    # vLLM's: `prompt_token_ids` on the response, `token_ids` on each choice (per chunk).
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # The client's id: the response id is `<chatcmpl|cmpl>-<request_id>` (vLLM's).
    request_id: str | None = None


def boolean_field(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean request field; null (or absent) is the default."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {type_name(value)}.", name)
    return value


def type_name(value: Any) -> str:
    """A JSON value's type as the API's error messages name it."""
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """Extra variables for the chat template; the names apply_chat_template itself takes
    (tokenize, tools, ...) would change how it runs, not what the template sees: refused."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object.",
                                  "chat_template_kwargs")
    # Imported here: transformers is heavy and only chat requests with kwargs need it.
    from transformers import PreTrainedTokenizerBase

    reserved = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    clash = sorted(name for name in value if name in reserved or name == "messages")
    if clash:
        raise InvalidRequestError(
            f"chat_template_kwargs must not set {', '.join(clash)}: use the request's own "
            "fields.", "chat_template_kwargs")
    return dict(value)


def _documents(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    value = body.get("documents")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidRequestError("documents must be an array of objects.", "documents")
    return value


def _truncation(body: dict[str, Any]) -> tuple[int | None, str]:
    size = body.get("truncate_prompt_tokens")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < -1
                             or size == 0):
        raise InvalidRequestError(
            "truncate_prompt_tokens must be -1 (the context length) or an integer >= 1.",
            "truncate_prompt_tokens")
    side = body.get("truncation_side")
    if side is None:
        side = "left"
    if side not in TRUNCATION_SIDES:
        raise InvalidRequestError("truncation_side must be \"left\" or \"right\".",
                                  "truncation_side")
    return size, side


def parse_prompt_options(body: dict[str, Any], *, chat: bool) -> PromptOptions:
    size, side = _truncation(body)
    # The chat template writes BOS itself (vLLM's chat default is false); a plain prompt
    # gets the tokenizer's special tokens.
    add_special_tokens = boolean_field(body, "add_special_tokens", not chat)
    if not chat:
        return PromptOptions(add_special_tokens=add_special_tokens, truncate_prompt_tokens=size,
                             truncation_side=side)
    add_generation_prompt = boolean_field(body, "add_generation_prompt", True)
    continue_final_message = boolean_field(body, "continue_final_message", False)
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message needs add_generation_prompt set to false (the open last "
            "message cannot be followed by a new assistant turn).", "continue_final_message")
    return PromptOptions(add_generation_prompt, continue_final_message, add_special_tokens,
                         size, side, _chat_template_kwargs(body), _documents(body))


def parse_output_options(body: dict[str, Any], *, logprobs: bool) -> OutputOptions:
    echo = boolean_field(body, "echo", False)
    if echo and logprobs:
        # vLLM answers echo with logprobs with the prompt's logprobs too, which the
        # verifier does not compute.
        raise InvalidRequestError(
            "echo together with logprobs is not supported (it needs the prompt's logprobs).",
            "echo")
    include_stop_str = boolean_field(body, "include_stop_str_in_output", False)
    skip_special_tokens = boolean_field(body, "skip_special_tokens", True)
    if include_stop_str and (body.get("stop_token_ids") or not skip_special_tokens):
        # The verifier does not stream the token that stopped it (EOS or a stop token id),
        # so only stop strings can be kept in the text.
        raise InvalidRequestError(
            "include_stop_str_in_output keeps stop strings only; it cannot be combined with "
            "stop_token_ids or skip_special_tokens false.", "include_stop_str_in_output")
    request_id = body.get("request_id")
    if request_id is not None and (not isinstance(request_id, str)
                                   or not _REQUEST_ID.match(request_id)):
        raise InvalidRequestError(
            "request_id must be 1 to 128 letters, digits, '_', '.', ':' or '-'.", "request_id")
    return OutputOptions(
        echo=echo,
        return_token_ids=boolean_field(body, "return_token_ids", False),
        include_stop_str_in_output=include_stop_str,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=boolean_field(body, "spaces_between_special_tokens", True),
        request_id=request_id,
    )


def truncate_prompt(prompt_token_ids: list[int], options: PromptOptions,
                    max_model_len: int) -> list[int]:
    """The prompt after `truncate_prompt_tokens` (vLLM's: -1 is the context length)."""
    size = options.truncate_prompt_tokens
    if size is None:
        return prompt_token_ids
    if size == -1:
        size = max_model_len
    elif size > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens ({size}) must be at most the context length "
            f"({max_model_len}).", "truncate_prompt_tokens")
    if len(prompt_token_ids) <= size:
        return prompt_token_ids
    if options.truncation_side == "right":
        return prompt_token_ids[:size]
    return prompt_token_ids[-size:]
