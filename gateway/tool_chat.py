"""Tool calls in a chat request: which constraint and template the request gets, how the
conversation's tool messages are rendered, and how each choice's text becomes OpenAI's
`tool_calls` (whole, or as streamed deltas).

gateway/tools.py, gateway/forced_tool_calls.py and gateway/hermes_tool_parser.py hold the
pieces (validation, the grammars that force calls, the Hermes parser); this module
applies OpenAI's and vLLM's rules for one request:

- "none": the tools are neither rendered nor enforced (OpenAI: the model answers in text);
- a named function or "required": the tool grammar forces the call(s); no template support
  is needed, so it works on every model;
- "auto": needs `--enable-auto-tool-choice` (400 naming `tool_choice`, as vLLM); the tools
  go through a chat template that renders `tools`, and where the template renders none
  (SmolLM2's) through specdec's own system message (`fallback_tool_prompt`); the output is
  parsed by the `--tool-call-parser`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from gateway.forced_tool_calls import ForcedToolCallStream, tool_calls_from_forced_output, tool_grammar
from gateway.hermes_tool_parser import (
    TOOL_CALL_PARSERS,
    HermesToolParser,
    parse_hermes,
    tool_messages_as_text,
)
from gateway.structured import GrammarRequest
from gateway.tools import ToolChoice, ToolFunction, parse_tool_choice, parse_tools
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
    through the template (None: none), specdec's own tool prompt for a template that renders
    none (None: not needed), and the tool choice the output is read with."""

    grammar: GrammarRequest | None
    template_tools: list[dict[str, Any]] | None
    request: ToolRequest
    parser: type[HermesToolParser] | None = None
    tool_prompt: str | None = None

    def prompt_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation with the fallback tool prompt in its system message (added
        before the first message, or after the client's own system text)."""
        if self.tool_prompt is None:
            return messages
        if messages and messages[0]["role"] == "system":
            system = messages[0]
            content = f"{system['content']}\n\n{self.tool_prompt}" if system["content"] else (
                self.tool_prompt)
            return [{**system, "content": content}, *messages[1:]]
        return [{"role": "system", "content": self.tool_prompt}, *messages]

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
                '"auto" tool choice (the default when tools are given) needs the server '
                "started with --enable-auto-tool-choice --tool-call-parser hermes (vLLM's "
                'flags); or set tool_choice to "required", a named function or "none".',
                "tool_choice")
        parser = TOOL_CALL_PARSERS[settings.tool_call_parser]
        template_tools = [_template_tool(tool) for tool in request.tools]
        if not settings.template_accepts_tools:
            return ToolPlan(None, None, request, parser, fallback_tool_prompt(template_tools))
        return ToolPlan(None, template_tools, request, parser)
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
        content, calls = parse_hermes(text, self._parser_class)
        if not self._parallel:
            calls = calls[:1]
        if calls:
            self.called = True
            return {"role": "assistant", "content": content, "tool_calls": calls}
        return {"role": "assistant", "content": content or ""}

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


def fallback_tool_prompt(tools: list[dict[str, Any]]) -> str:
    """specdec's system text for a chat template that renders no tools: every function's
    JSON schema and the Hermes call format that `--tool-call-parser hermes` reads back (the
    text Hermes-style templates such as Qwen's write themselves)."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


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
