"""Chat messages: validated (`parse_messages`), then rendered to prompt token ids through
the model's own chat template."""

from __future__ import annotations

import logging
from typing import Any

from jinja2.exceptions import TemplateError

from gateway.request_options import PromptOptions
from gateway.tool_chat import parse_message_tool_calls
from specdec.errors import InvalidRequestError

logger = logging.getLogger(__name__)

TEMPLATE_REJECTED_MESSAGE = ("The chat template could not render these messages; check their "
                             "roles, their order and their content.")
UNTOKENIZABLE_MESSAGE = "The prompt could not be tokenized."
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# A template's own raise_exception text is the model's rule ("roles must alternate"), worth
# passing on; it is cut short, since nothing else bounds what a template may say.
MAX_TEMPLATE_MESSAGE_CHARS = 300


def _template_rejection(exc: Exception) -> str:
    # transformers' raise_exception raises exactly TemplateError; its subclasses (syntax,
    # undefined names) and every other exception describe the template or the library
    # (file names, line numbers, Python types), which a client has no use for.
    if type(exc) is TemplateError and str(exc):
        reason = str(exc)[:MAX_TEMPLATE_MESSAGE_CHARS]
        return f"The chat template rejected the messages: {reason}"
    return TEMPLATE_REJECTED_MESSAGE


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: its longest vocabulary entry
    (a byte-level entry has a character per byte, and a character is at least a byte)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def check_text_fits(text: str, max_tokens: int | None, chars_per_token: int, param: str) -> None:
    """Refuses text that cannot fit in `max_tokens` tokens however it tokenizes, before it
    is tokenized (10 MB of tool-call arguments took 18 s to tokenize, to be refused after)."""
    if max_tokens is not None and len(text) > max_tokens * chars_per_token:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_tokens} tokens. However, your "
            f"{param} has {len(text)} characters, more than that many tokens can hold.", param)


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None,
                       options: PromptOptions | None = None, *,
                       max_model_len: int | None = None, chars_per_token: int = 1) -> list[int]:
    """Applies the chat template (with the generation prompt unless `options` say otherwise),
    then tokenizes. `tools` (OpenAI's tool objects) reach the template only when given:
    tool_choice "auto" on a template that renders them.

    The template is rendered to text first and encoded without adding special tokens
    (unless asked): the template itself writes BOS and role markers (vLLM does the same).
    Text longer than `max_model_len` tokens of `chars_per_token` characters is refused
    untokenized.
    """
    options = options or PromptOptions()
    extra: dict[str, Any] = dict(options.chat_template_kwargs)
    if tools:
        extra["tools"] = tools
    if options.documents is not None:
        extra["documents"] = options.documents
    if options.continue_final_message:
        extra["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=options.add_generation_prompt, tokenize=False,
            **extra)
    except Exception as exc:  # jinja2 TemplateError / raise_exception, or no template set
        logger.info("the chat template rejected a request: %s: %s", type(exc).__name__, exc)
        raise InvalidRequestError(_template_rejection(exc), "messages") from None
    if not isinstance(text, str):
        raise InvalidRequestError("The chat template did not render to text.", "messages")
    check_text_fits(text, max_model_len, chars_per_token, "messages")
    return _encode(tokenizer, text, add_special_tokens=options.add_special_tokens,
                   param="messages")


def tokenize_prompt(tokenizer: Any, prompt: str | list[int],
                    add_special_tokens: bool = True) -> list[int]:
    """A completion prompt: text gets the tokenizer's special tokens (BOS) unless asked not
    to, ids pass as given."""
    if isinstance(prompt, str):
        return _encode(tokenizer, prompt, add_special_tokens=add_special_tokens, param="prompt")
    vocab_size = len(tokenizer)
    if any(token_id >= vocab_size for token_id in prompt):
        raise InvalidRequestError(
            f"prompt token ids must be below the vocabulary size {vocab_size}.", "prompt")
    return list(prompt)


def _encode(tokenizer: Any, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception:  # text the request checks let through: the client gets no internals
        logger.warning("the tokenizer failed on a request's %s", param, exc_info=True)
        raise InvalidRequestError(UNTOKENIZABLE_MESSAGE, param) from None


def _message_content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        if message["role"] == "assistant":
            return ""
        raise InvalidRequestError(f"messages[{index}].content is required.", "messages")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}].content parts must be {{\"type\": \"text\", "
                    "\"text\": string}; only text content is supported.", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or an array of text parts.", "messages")


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise InvalidRequestError("messages is required.", "messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("messages must be a non-empty array.", "messages")
    messages = []
    # OpenAI refuses a tool message that answers no call made before it.
    call_ids: set[str] = set()
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{index}] must be an object.", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, got "
                f"{role!r}.", "messages")
        parsed: dict[str, Any] = {"role": "system" if role == "developer" else role,
                  "content": _message_content(message, index)}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequestError(f"messages[{index}].name must be a string.",
                                          "messages")
            parsed["name"] = name
        if role == "assistant" and message.get("tool_calls"):
            parsed["tool_calls"] = parse_message_tool_calls(message["tool_calls"], index)
            call_ids.update(call["id"] for call in parsed["tool_calls"])
        tool_call_id = message.get("tool_call_id")
        if role == "tool" and tool_call_id is not None:
            if not isinstance(tool_call_id, str):
                raise InvalidRequestError(f"messages[{index}].tool_call_id must be a string.",
                                          "messages")
            if tool_call_id not in call_ids:
                raise InvalidRequestError(
                    f"messages[{index}].tool_call_id {tool_call_id[:64]!r} answers no tool call "
                    "of an earlier assistant message.", f"messages[{index}].tool_call_id")
            parsed["tool_call_id"] = tool_call_id
        messages.append(parsed)
    return messages
