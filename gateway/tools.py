"""OpenAI tool calls: `tools` / `tool_choice` validation, the grammar that forces a call, and
the Hermes-style parser for `tool_choice: "auto"`.

- "none": no tools offered to the output; plain text.
- "auto": the tools go through the chat template (only if it renders them: see
  `template_accepts_tools`); the model's text is parsed for Hermes-style calls,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, streaming or not.
- a named function: the output is forced to that function's arguments object (a JSON Schema
  grammar of its `parameters`), as vLLM does; the response wraps it as the one call.
- "required": the output is forced to a JSON array of one or more
  `{"name": <a tool's name>, "parameters": <its arguments>}` items, vLLM's form: it needs no
  template support (SmolLM2's template has none) and the array parses with json.loads.

Tool-call deltas and messages follow OpenAI's shape; ids are `call_<24 random chars>`.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from gateway.structured import GrammarRequest
from specdec.errors import InvalidRequestError

logger = logging.getLogger(__name__)

MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_ID_ALPHABET = string.ascii_letters + string.digits
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


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


def tool_grammar(choice: ToolChoice, tools: tuple[ToolFunction, ...], *,
                 parallel: bool = True) -> GrammarRequest | None:
    """The constraint that forces a valid call ("required", a named function); else None.
    With `parallel` false, "required" makes exactly one call (OpenAI's parallel_tool_calls)."""
    if choice.mode == "function":
        index = next(i for i, tool in enumerate(tools) if tool.name == choice.name)
        return GrammarRequest("json_schema", json.dumps(tools[index].parameters),
                              f"tools[{index}].function.parameters")
    if choice.mode == "required":
        items = [{"type": "object",
                  "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for tool in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return GrammarRequest("json_schema", json.dumps(schema), "tools")
    return None


def tool_calls_from_forced_output(choice: ToolChoice, text: str) -> list[dict[str, Any]]:
    """The `tool_calls` of a response whose text the tool grammar forced."""
    if choice.mode == "function":
        return [_tool_call(choice.name or "", text.strip())]
    if choice.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            # Only when generation stopped early (max_tokens): the grammar was not finished;
            # the calls are returned as far as they were generated.
            return [_tool_call(name, arguments)
                    for name, arguments in partial_required_calls(text)]
        return [_tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
                for call in calls]
    raise ValueError(f"tool choice {choice.mode!r} does not force a call")


class ForcedToolCallStream:
    """Streaming tool-call deltas for output a tool grammar forces.

    A named function streams its arguments as they are generated: the first delta carries
    index 0, the id, the type and the name, later ones only argument text (OpenAI's shape).
    "required" output is a JSON array whose calls are known only once it closes: `finish`
    returns them, one whole delta each.
    """

    def __init__(self, choice: ToolChoice) -> None:
        if choice.mode not in ("function", "required"):
            raise ValueError(f"tool choice {choice.mode!r} does not force a call")
        self._choice = choice
        self._text = ""
        self._started = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        if self._choice.mode != "function" or not text:
            return []
        if not self._started:
            self._started = True
            return [{"index": 0, **_tool_call(self._choice.name or "", text)}]
        return [{"index": 0, "function": {"arguments": text}}]

    def finish(self) -> list[dict[str, Any]]:
        if self._choice.mode == "function":
            if self._started:
                return []
            return [{"index": 0, **_tool_call(self._choice.name or "", "")}]
        calls = tool_calls_from_forced_output(self._choice, self._text)
        return [{"index": index, **call} for index, call in enumerate(calls)]


def tool_messages_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversation messages for a chat template without tool support.

    An assistant message's `tool_calls` become Hermes `<tool_call>` text in its content (the
    form "auto" parses back), and a `tool` message's content is wrapped as a
    `<tool_response>`; SmolLM2's template, for one, fails on an assistant message whose
    content is null. Other messages pass unchanged.
    """
    converted = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            parts = [message["content"]] if message.get("content") else []
            for call in message["tool_calls"]:
                function = call.get("function", {})
                arguments = function.get("arguments", "{}")
                try:
                    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
                except ValueError:
                    parsed = arguments
                body = json.dumps({"name": function.get("name"), "arguments": parsed}, ensure_ascii=False)
                parts.append(f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}")
            converted.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            content = _text_content(message.get("content"))
            converted.append({"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            converted.append(message)
    return converted


def _text_content(content: Any) -> str:
    """A message's content as text: a string, or the text of its content parts."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _tool_call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
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


@dataclass(slots=True)
class ParserDelta:
    """What one `feed` adds: text for `content` and OpenAI tool-call deltas."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class HermesToolParser:
    """Streams Hermes-style output: content outside `<tool_call>` tags, one tool-call delta
    (id, name and the whole arguments string) when each tag closes.

    Text that may be the start of a tag is held back until it is known not to be. A tag
    whose body is not a call ({"name", "arguments"} JSON) is returned as content.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._pending_space = ""  # whitespace between calls: content only if text follows
        self.tool_calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> ParserDelta:
        self._buffer += text
        delta = ParserDelta()
        while True:
            if self._inside:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return delta
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE):]
                self._inside = False
                self._emit_call(body, delta, closed=True)
                continue
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                self._emit_content(self._buffer[:start], delta)
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
                self._inside = True
                continue
            keep = _partial_suffix(self._buffer, TOOL_CALL_OPEN)
            self._emit_content(self._buffer[:len(self._buffer) - keep], delta)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return delta

    def finish(self) -> ParserDelta:
        """The rest at the end of generation (an unclosed last call is parsed if whole)."""
        delta = ParserDelta()
        if self._inside:
            self._inside = False
            self._emit_call(self._buffer, delta, closed=False)
        else:
            self._emit_content(self._buffer, delta)
        self._buffer = ""
        if not self.tool_calls and self._pending_space:
            delta.content += self._pending_space
        self._pending_space = ""
        return delta

    def _emit_content(self, text: str, delta: ParserDelta) -> None:
        # Trailing whitespace is held: dropped if a call follows (the space between text and
        # a call, or between calls, is layout, not content), sent if text follows. Holding it
        # however the text was split keeps streaming and non-streaming results equal.
        body = text.rstrip()
        if body:
            delta.content += self._pending_space + body
            self._pending_space = ""
        self._pending_space += text[len(body):]

    def _emit_call(self, body: str, delta: ParserDelta, *, closed: bool) -> None:
        # A call cut short (max_tokens) is returned as far as it was generated: its name and
        # the start of its arguments (finish_reason stays "length").
        call = _parse_call(body) if closed else (_parse_call(body) or _partial_call(body))
        if call is None:
            raw = TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else "")
            delta.content += self._pending_space + raw
            self._pending_space = ""
            return
        self._pending_space = ""
        name, arguments = call
        tool_call = _tool_call(name, arguments, index=len(self.tool_calls))
        self.tool_calls.append(tool_call)
        delta.tool_calls.append(tool_call)


def parse_hermes(text: str, parser_class: type[HermesToolParser] = HermesToolParser,
                 ) -> tuple[str | None, list[dict[str, Any]]]:
    """Non-streaming: (content or None, tool_calls without `index`) of a whole output."""
    parser = parser_class()
    first = parser.feed(text)
    last = parser.finish()
    content = first.content + last.content
    calls = [{key: value for key, value in call.items() if key != "index"} for call in parser.tool_calls]
    if calls and not content.strip():
        return None, calls
    return content, calls


def _parse_call(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


# The start of a Hermes call whose arguments were cut short: its name is whole.
_PARTIAL_CALL = re.compile(r'^\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*',
                           re.DOTALL)


def _partial_call(body: str) -> tuple[str, str] | None:
    """(name, the arguments text generated so far) of a call cut short, if its name is whole."""
    match = _PARTIAL_CALL.match(body)
    if match is None:
        return None
    return match.group(1), body[match.end():]


def partial_required_calls(text: str) -> list[tuple[str, str]]:
    """The calls of a "required" array cut short (max_tokens): every whole item, then the
    last one as far as it was generated (its name and the start of its parameters)."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    position = text.find("[") + 1
    while position > 0:
        while position < len(text) and text[position] in " \n\t\r,":
            position += 1
        try:
            item, position = decoder.raw_decode(text, position)
        except ValueError:
            partial = _partial_call(text[position:])
            if partial is not None:
                calls.append(partial)
            break
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append((item["name"], json.dumps(item.get("parameters", {}),
                                                   ensure_ascii=False)))
    return calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


# `--tool-call-parser` values (vLLM's flag): the parser class for tool_choice "auto".
TOOL_CALL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
