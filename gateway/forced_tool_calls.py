"""Tool calls a grammar forces, as vLLM does: a named function's output is its arguments
object (a JSON Schema grammar of its `parameters`), wrapped by the response as the one call;
"required" output is a JSON array of one or more `{"name": <a tool's name>, "parameters":
<its arguments>}` items, which needs no template support (SmolLM2's template has none) and
parses with json.loads.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.hermes_tool_parser import partial_call
from gateway.structured import GrammarRequest
from gateway.tools import ToolChoice, ToolFunction, tool_call


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
        return [tool_call(choice.name or "", text.strip())]
    if choice.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            # Only when generation stopped early (max_tokens): the grammar was not finished;
            # the calls are returned as far as they were generated.
            return [tool_call(name, arguments)
                    for name, arguments in partial_required_calls(text)]
        return [tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
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
            return [{"index": 0, **tool_call(self._choice.name or "", text)}]
        return [{"index": 0, "function": {"arguments": text}}]

    def finish(self) -> list[dict[str, Any]]:
        if self._choice.mode == "function":
            if self._started:
                return []
            return [{"index": 0, **tool_call(self._choice.name or "", "")}]
        calls = tool_calls_from_forced_output(self._choice, self._text)
        return [{"index": index, **call} for index, call in enumerate(calls)]


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
            partial = partial_call(text[position:])
            if partial is not None:
                calls.append(partial)
            break
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append((item["name"], json.dumps(item.get("parameters", {}),
                                                   ensure_ascii=False)))
    return calls
