"""The Hermes-style tool-call format of tool_choice "auto" (`--tool-call-parser hermes`):
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks in the model's text,
read streaming or whole, and the conversation's earlier calls written back in it for a
chat template that renders no tools.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.tools import tool_call

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


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
        call = _parse_call(body) if closed else (_parse_call(body) or partial_call(body))
        if call is None:
            raw = TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else "")
            delta.content += self._pending_space + raw
            self._pending_space = ""
            return
        self._pending_space = ""
        name, arguments = call
        new_call = tool_call(name, arguments, index=len(self.tool_calls))
        self.tool_calls.append(new_call)
        delta.tool_calls.append(new_call)


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


def partial_call(body: str) -> tuple[str, str] | None:
    """(name, the arguments text generated so far) of a call cut short, if its name is whole."""
    match = _PARTIAL_CALL.match(body)
    if match is None:
        return None
    return match.group(1), body[match.end():]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


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


# `--tool-call-parser` values (vLLM's flag): the parser class for tool_choice "auto".
TOOL_CALL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
