"""Tool calls in a chat request: which constraint and template the request gets, how the
conversation's tool messages are rendered, and how each choice's text becomes OpenAI's
`tool_calls` (whole, or as streamed deltas).

gateway/tools.py holds the pieces (validation, grammars, the Hermes parser); this module
applies OpenAI's and vLLM's rules for one request:

- "none": the tools are neither rendered nor enforced (OpenAI: the model answers in text);
- a named function or "required": the tool grammar forces the call(s); no template support
  is needed, so it works on every model;
- "auto": needs `--enable-auto-tool-choice` (400 naming `tool_choice`, as vLLM) and a chat
  template that renders `tools` (400 naming `tools`); the output is parsed by the
  `--tool-call-parser`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from gateway.structured import GrammarRequest
from gateway.tools import (
    TOOL_CALL_PARSERS,
    ForcedToolCallStream,
    HermesToolParser,
    ToolChoice,
    ToolFunction,
    parse_tool_choice,
    parse_tools,
    tool_calls_from_forced_output,
    tool_grammar,
    tool_messages_as_text,
)
from specdec.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, validated."""

    tools: tuple[ToolFunction, ...] = ()
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel: bool = True


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The gateway's flags (`--enable-auto-tool-choice`, `--tool-call-parser`) and whether
    the model's chat template renders `tools` (probed once at start-up)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    template_accepts_tools: bool = False


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one request gets: the grammar that forces a call (or None), the tools to render
    through the template (None: none), and the tool choice the output is read with."""

    grammar: GrammarRequest | None
    template_tools: list[dict[str, Any]] | None
    request: ToolRequest
    parser: type[HermesToolParser] | None = None

    def new_output(self) -> ToolOutput | None:
        """A fresh per-choice reader of the output; None: plain text."""
        if self.request.choice.mode in ("function", "required"):
            return ForcedOutput(self.request.choice)
        if self.parser is not None:
            return ParsedOutput(self.parser, self.request.parallel)
        return None


def parse_tool_request(body: dict[str, Any]) -> ToolRequest:
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean.", "parallel_tool_calls")
    return ToolRequest(tools, choice, True if parallel is None else parallel)


def plan_tools(request: ToolRequest, output_grammar: GrammarRequest | None,
               settings: ToolSettings) -> ToolPlan:
    """Raises InvalidRequestError for what this gateway or model cannot do."""
    mode = request.choice.mode
    if mode == "none":
        return ToolPlan(None, None, request)
    if mode == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise InvalidRequestError(
                '"auto" tool choice (the default when tools are given) needs the gateway '
                "started with --enable-auto-tool-choice and --tool-call-parser; set tool_choice "
                'to "required", a named function or "none" instead.', "tool_choice")
        if not settings.template_accepts_tools:
            raise InvalidRequestError(
                "This model's chat template does not render tools, so tool_choice \"auto\" "
                'cannot offer them; use tool_choice "required" or a named function, which '
                "need no template support.", "tools")
        return ToolPlan(None, [_template_tool(tool) for tool in request.tools], request,
                        TOOL_CALL_PARSERS[settings.tool_call_parser])
    if output_grammar is not None:
        field = output_grammar.param.split(".", 1)[0]
        raise InvalidRequestError(
            f"tool_choice {_describe(request.choice)} and {field} both constrain the output; "
            "give only one.", field)
    return ToolPlan(tool_grammar(request.choice, request.tools, parallel=request.parallel),
                    None, request)


def template_messages(messages: list[dict[str, Any]],
                      template_accepts_tools: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template gets it. A template that takes tools gets the
    assistant's calls with `arguments` as objects (what Hugging Face templates expect, as
    vLLM passes them); one that does not gets them as Hermes text (tool_messages_as_text)."""
    if not template_accepts_tools:
        return tool_messages_as_text(messages)
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_call_with_object_arguments(c) for c in calls]}
        rendered.append(message)
    return rendered


def parse_message_tool_calls(value: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked: [{id, type, function: {name, arguments}}]."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array.", "messages")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", "{}"), (str, dict))
                or call.get("type", "function") != "function"
                or not isinstance(call.get("id", ""), str)):
            raise InvalidRequestError(
                f"{where} items must be {{\"id\": string, \"type\": \"function\", \"function\": "
                "{\"name\": string, \"arguments\": string}}.", "messages")
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"],
                                   "arguments": function.get("arguments", "{}")}})
    return calls


class ToolOutput:
    """One choice's text read as tool calls: `feed` / `finish` give streamed delta fields,
    `message` the whole non-streamed message; `called` once a call was made."""

    called = False

    def feed(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self) -> dict[str, Any]:
        raise NotImplementedError

    def message(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def finish_reason(self, reason: str | None) -> str | None:
        # A call that was cut short (length) keeps its reason: its arguments are not whole.
        return "tool_calls" if self.called and reason == "stop" else reason


class ForcedOutput(ToolOutput):
    """Output a tool grammar forced: the arguments of a named function, or vLLM's
    `[{"name", "parameters"}, ...]` array for "required"."""

    def __init__(self, choice: ToolChoice) -> None:
        self._choice = choice
        self._stream = ForcedToolCallStream(choice)
        self._text = ""

    def feed(self, text: str) -> dict[str, Any]:
        self._text += text
        deltas = self._stream.feed(text)
        if deltas:
            self.called = True
        return {"tool_calls": deltas} if deltas else {}

    def finish(self) -> dict[str, Any]:
        deltas = self._stream.finish()
        if deltas:
            self.called = True
            return {"tool_calls": deltas}
        # "required" cut short (max_tokens): no call parses; the text is all there is.
        return {"content": self._text} if not self.called and self._text else {}

    def message(self, text: str) -> dict[str, Any]:
        calls = tool_calls_from_forced_output(self._choice, text)
        self.called = bool(calls)
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": None, "tool_calls": calls}


class ParsedOutput(ToolOutput):
    """tool_choice "auto": the model's own tool-call syntax, read by the configured parser.
    With parallel_tool_calls false only the first call is kept."""

    def __init__(self, parser: type[HermesToolParser], parallel: bool) -> None:
        self._parser_class = parser
        self._parser = parser()
        self._parallel = parallel

    def feed(self, text: str) -> dict[str, Any]:
        delta = self._parser.feed(text)
        return self._fields(delta.content, delta.tool_calls)

    def finish(self) -> dict[str, Any]:
        delta = self._parser.finish()
        return self._fields(delta.content, delta.tool_calls)

    def message(self, text: str) -> dict[str, Any]:
        parser = self._parser_class()
        first, last = parser.feed(text), parser.finish()
        content = first.content + last.content
        calls = [{k: v for k, v in call.items() if k != "index"} for call in parser.tool_calls]
        if not self._parallel:
            calls = calls[:1]
        if not calls:
            return {"role": "assistant", "content": content}
        self.called = True
        return {"role": "assistant", "content": content if content.strip() else None,
                "tool_calls": calls}

    def _fields(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        if not self._parallel:
            calls = [call for call in calls if call["index"] == 0]
        fields: dict[str, Any] = {}
        if content:
            fields["content"] = content
        if calls:
            self.called = True
            fields["tool_calls"] = calls
        return fields


def _template_tool(tool: ToolFunction) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _call_with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the text as the client sent it
    return {**call, "function": {**function, "arguments": arguments}}


def _describe(choice: ToolChoice) -> str:
    return f"function {choice.name!r}" if choice.mode == "function" else f"{choice.mode!r}"
