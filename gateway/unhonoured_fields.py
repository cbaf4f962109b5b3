"""Known OpenAI (and vLLM) request fields that specdec cannot honour: refused, not ignored.

Each is accepted at its default (null, or a value that changes nothing) and refused with a
400 naming it otherwise, so a client never gets an answer that silently dropped part of
its request. Truly unknown fields stay ignored (gateway/protocol.py).
"""

from __future__ import annotations

import json
from typing import Any

from specdec.errors import InvalidRequestError

# Known fields that change nothing at their default and that specdec cannot honour
# otherwise: (name, the accepted values besides null). Refused with a 400 naming the field.
# (`response_format`, `tools`, `tool_choice` and vLLM's guided_* / structured_outputs are
# honoured: gateway/structured.py and gateway/tool_chat.py.)
_UNSUPPORTED_UNLESS_DEFAULT: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("functions", ([],)),
    ("function_call", ("none",)),
    ("audio", ()),
    ("modalities", (["text"],)),
    ("prediction", ()),
    ("service_tier", ("auto", "default")),
    ("store", (False,)),
    ("metadata", ({},)),
    ("reasoning_effort", ()),
    ("verbosity", ()),
    ("web_search_options", ()),
    # vLLM's extensions that would change the output or the answer's shape.
    ("allowed_token_ids", ()),
    ("bad_words", ([],)),
    ("use_beam_search", (False,)),
    ("length_penalty", (1.0, 1)),  # beam search only
    ("prompt_logprobs", ()),
    ("logprob_token_ids", ()),
    ("return_tokens_as_token_ids", (False,)),
    ("return_prompt_text", (False,)),
    ("watermarking", (False,)),
    ("thinking_token_budget", (-1,)),
    ("include_reasoning", (True,)),  # no reasoning parser: nothing to leave out
    ("repetition_detection", ()),
    ("stream_interval", (1,)),
    ("priority", (0,)),  # no priority scheduling (vLLM refuses it too then)
    # A request's own template would run client-written Jinja (vLLM needs
    # --trust-request-chat-template for it).
    ("chat_template", ()),
    ("prompt_embeds", ()),
    ("media_io_kwargs", ({},)),
    ("mm_processor_kwargs", ({},)),
    ("kv_transfer_params", ({},)),
    ("ec_transfer_params", ({},)),
    ("vllm_xargs", ({},)),
    ("routed_experts_prompt_start", (0,)),
    # vLLM reads these on its /render routes only.
    ("return_token_offsets", (False,)),
    ("return_mm_kwargs", (True,)),
    # vLLM's older names.
    ("logits_processors", ([],)),
    ("guided_whitespace_pattern", ()),
)


def refuse_unhonoured_fields(body: dict[str, Any]) -> None:
    """Raises `InvalidRequestError` naming the first field above set to a non-default value."""
    for name, accepted in _UNSUPPORTED_UNLESS_DEFAULT:
        value = body.get(name)
        # Same type and value: `0 == False` must not let `"store": 0` through as the default.
        if value is None or any(type(value) is type(ok) and value == ok for ok in accepted):
            continue
        allowed = " or ".join(json.dumps(ok) for ok in accepted)
        hint = f" (only {allowed} is accepted)" if allowed else ""
        raise InvalidRequestError(f"{name} is not supported{hint}.", name)
    parallel_tool_calls = body.get("parallel_tool_calls")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean.", "parallel_tool_calls")
