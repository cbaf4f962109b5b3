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
    # vLLM's extensions that would change the output.
    ("allowed_token_ids", ()),
    ("bad_words", ([],)),
    ("use_beam_search", (False,)),
    ("prompt_logprobs", ()),
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
