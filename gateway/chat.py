"""Chat messages -> prompt token ids through the model's own chat template."""

from __future__ import annotations

import logging
from typing import Any

from jinja2.exceptions import TemplateError

from specdec.errors import InvalidRequestError

logger = logging.getLogger(__name__)

TEMPLATE_REJECTED_MESSAGE = ("The chat template could not render these messages; check their "
                             "roles, their order and their content.")
UNTOKENIZABLE_MESSAGE = "The prompt could not be tokenized."
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


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Applies the chat template with the generation prompt, then tokenizes.

    The template is rendered to text first and encoded without adding special tokens:
    the template itself writes BOS and role markers (vLLM does the same).
    """
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:  # jinja2 TemplateError / raise_exception, or no template set
        logger.info("the chat template rejected a request: %s: %s", type(exc).__name__, exc)
        raise InvalidRequestError(_template_rejection(exc), "messages") from None
    if not isinstance(text, str):
        raise InvalidRequestError("The chat template did not render to text.", "messages")
    return _encode(tokenizer, text, add_special_tokens=False, param="messages")


def tokenize_prompt(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """A completion prompt: text gets the tokenizer's special tokens (BOS), ids pass as given."""
    if isinstance(prompt, str):
        return _encode(tokenizer, prompt, add_special_tokens=True, param="prompt")
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
