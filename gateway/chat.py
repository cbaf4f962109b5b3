"""Chat messages -> prompt token ids through the model's own chat template."""

from __future__ import annotations

from typing import Any

from specdec.errors import InvalidRequestError


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Applies the chat template with the generation prompt, then tokenizes.

    The template is rendered to text first and encoded without adding special tokens:
    the template itself writes BOS and role markers (vLLM does the same).
    """
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:  # jinja2 TemplateError / raise_exception, or no template set
        raise InvalidRequestError(f"The chat template rejected the messages: {exc}",
                                  "messages") from None
    if not isinstance(text, str):
        raise InvalidRequestError("The chat template did not render to text.", "messages")
    return list(tokenizer.encode(text, add_special_tokens=False))


def tokenize_prompt(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """A completion prompt: text gets the tokenizer's special tokens (BOS), ids pass as given."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    vocab_size = len(tokenizer)
    if any(token_id >= vocab_size for token_id in prompt):
        raise InvalidRequestError(
            f"prompt token ids must be below the vocabulary size {vocab_size}.", "prompt")
    return list(prompt)
