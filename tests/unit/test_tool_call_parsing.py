"""Reading tool calls out of a model's text: the Hermes parser of tool_choice "auto"
(gateway/hermes_tool_parser.py), whole and streamed, and the stream of calls a tool grammar
forces (gateway/forced_tool_calls.py); every call is checked against the openai package's
own types."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionMessageToolCall
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall

from gateway.forced_tool_calls import ForcedToolCallStream, tool_calls_from_forced_output
from gateway.hermes_tool_parser import HermesToolParser, parse_hermes, tool_messages_as_text
from gateway.tools import ToolChoice

# -- Hermes parser ---------------------------------------------------------------------------

HERMES_OUTPUT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                 '"unit": "C", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                 '"arguments": {"zone": "UTC"}}\n</tool_call>')


def test_hermes_non_streaming() -> None:
    content, calls = parse_hermes(HERMES_OUTPUT)
    assert content == "Let me check."
    assert [call["function"]["name"] for call in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C", "days": 2}
    for call in calls:
        ChatCompletionMessageToolCall.model_validate(call)
    assert parse_hermes("just text, no <tool call") == ("just text, no <tool call", [])
    assert parse_hermes('<tool_call>{"name": "ping", "arguments": {}}</tool_call>')[0] is None


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_hermes_streaming_matches_non_streaming(chunk: int) -> None:
    parser = HermesToolParser()
    content = ""
    deltas = []
    for start in range(0, len(HERMES_OUTPUT), chunk):
        delta = parser.feed(HERMES_OUTPUT[start:start + chunk])
        content += delta.content
        deltas += delta.tool_calls
        assert "<" not in delta.content, "a partial tag is never sent as content"
    last = parser.finish()
    content += last.content
    deltas += last.tool_calls
    assert content == "Let me check."
    assert [d["index"] for d in deltas] == [0, 1]
    for delta in deltas:
        parsed = ChoiceDeltaToolCall.model_validate(delta)
        assert parsed.id and parsed.id.startswith("call_") and parsed.type == "function"
    assert [d["function"]["name"] for d in deltas] == ["get_weather", "get_time"]


def test_hermes_bad_body_is_content_and_unclosed_call_is_parsed() -> None:
    content, calls = parse_hermes("<tool_call>not json</tool_call> tail")
    assert calls == [] and content == "<tool_call>not json</tool_call> tail"
    content, calls = parse_hermes('ok <tool_call>\n{"name": "ping", "arguments": "{}"}\n')
    assert content == "ok" and calls[0]["function"] == {"name": "ping", "arguments": "{}"}
    parser = HermesToolParser()
    assert parser.feed("a <tool_").content == "a"
    assert parser.finish().content == " <tool_"


# -- streaming forced calls ----------------------------------------------------------------

def test_forced_named_call_streams_arguments() -> None:
    stream = ForcedToolCallStream(ToolChoice("function", "get_time"))
    deltas = stream.feed('{"zone": ') + stream.feed('"UTC"}') + stream.finish()
    first = ChoiceDeltaToolCall.model_validate(deltas[0])
    assert first.index == 0 and first.id and first.function.name == "get_time"
    assert [ChoiceDeltaToolCall.model_validate(d).index for d in deltas] == [0, 0]
    assert "id" not in deltas[1]
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"zone": "UTC"}'


def test_forced_required_calls_come_whole_at_the_end() -> None:
    stream = ForcedToolCallStream(ToolChoice("required"))
    text = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "ping", "parameters": {}}]'
    assert stream.feed(text[:20]) == [] and stream.feed(text[20:]) == []
    deltas = stream.finish()
    assert [d["index"] for d in deltas] == [0, 1]
    assert [d["function"]["name"] for d in deltas] == ["get_time", "ping"]
    assert json.loads(deltas[0]["function"]["arguments"]) == {"zone": "CET"}
    for delta in deltas:
        ChoiceDeltaToolCall.model_validate(delta)


def test_a_required_array_cut_short_gives_its_calls_so_far() -> None:
    text = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "ping", "param'
    calls = tool_calls_from_forced_output(ToolChoice("required"), text)
    assert [call["function"]["name"] for call in calls] == ["get_time"]
    text = '[{"name": "get_time", "parameters": {"zo'
    (call,) = tool_calls_from_forced_output(ToolChoice("required"), text)
    assert call["function"] == {"name": "get_time", "arguments": '{"zo'}


def test_earlier_calls_written_as_hermes_text_parse_back() -> None:
    messages = [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    content, calls = parse_hermes(tool_messages_as_text(messages)[0]["content"])
    assert content == "Checking."
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
