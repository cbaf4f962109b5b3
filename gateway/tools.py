"""OpenAI tool calls: the request's `tools` and `tool_choice`, validated, and what the
other tool modules share (call ids, a call's OpenAI shape, whether a chat template renders
tools).

- "none": no tools offered to the output; plain text.
- "auto": the tools go through the chat template (only if it renders them: see
  `template_accepts_tools`); the model's text is read by a tool-call parser
  (gateway/hermes_tool_parser.py), streaming or not.
- a named function or "required": a grammar forces the call(s)
  (gateway/forced_tool_calls.py).

Tool-call deltas and messages follow OpenAI's shape; ids are `call_<24 random chars>`.
"""

from __future__ import annotations

import logging
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from specdec.errors import InvalidRequestError

logger = logging.getLogger(__name__)

MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolFunction:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool | None = None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """mode: "none", "auto", "required" or "function" (then `name` is the function)."""

    mode: str
    name: str | None = None


def new_tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def parse_tools(tools: Any) -> tuple[ToolFunction, ...]:
    """The request's `tools`, validated; () when absent."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be an array", param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools has more than {MAX_TOOLS} entries", param="tools")
    parsed: list[ToolFunction] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(f"{where}.type must be 'function'", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{where}.function must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                param=f"{where}.function.name")
        if any(existing.name == name for existing in parsed):
            raise InvalidRequestError(f"two tools are named {name!r}", param=f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description must be a string",
                                      param=f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = dict(_EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON Schema object",
                                      param=f"{where}.function.parameters")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.function.strict must be a boolean",
                                      param=f"{where}.function.strict")
        parsed.append(ToolFunction(name, description, parameters, strict))
    return tuple(parsed)


def parse_tool_choice(tool_choice: Any, tools: tuple[ToolFunction, ...]) -> ToolChoice:
    """OpenAI's semantics: default "auto" with tools, "none" without."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be 'none', 'auto', 'required' or a function, not {tool_choice!r}",
                param="tool_choice")
        if tool_choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return ToolChoice(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice.function.name must be a string",
                                      param="tool_choice.function.name")
        if not any(tool.name == name for tool in tools):
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools",
                                      param="tool_choice.function.name")
        return ToolChoice("function", name)
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        param="tool_choice")


def tool_call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"id": new_tool_call_id(), "type": "function",
                            "function": {"name": name, "arguments": arguments}}
    if index is not None:
        call = {"index": index, **call}
    return call


def template_accepts_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders `tools` (transformers' apply_chat_template(tools=)).

    A template that ignores the variable renders the same text with and without a tool;
    then "auto" cannot tell the model about the tools (the gateway answers 400 on `tools`).
    """
    probe_tool = {"type": "function", "function": {
        "name": "specdec_probe_tool", "description": "probe",
        "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(messages, tools=[probe_tool], tokenize=False,
                                                   add_generation_prompt=True)
    except Exception as error:
        logger.info("chat template cannot render tools: %s", error)
        return False
    return plain != with_tools
