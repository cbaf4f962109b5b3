"""OpenAI's Responses API (`/v1/responses`) over the chat pipeline.

A Responses request becomes a chat request (`chat_body`): `instructions` the system
message, `input` (a string or a list of messages, function calls and their outputs) the
conversation, `text.format` the response_format, flat function tools the chat tools. The
chat answer becomes a Response object (`response_object`), or, streamed, the Responses
events (`response_events`): response.created, response.in_progress, then per output item
output_item.added, content_part.added, output_text.delta... (or
function_call_arguments.delta...), their .done events, and response.completed (or
response.incomplete when max_output_tokens cut the answer). No response store is kept, so
`previous_response_id` and `store: true` are 400s naming them (vLLM's without its store).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from specdec.errors import InvalidRequestError

# Responses fields that change nothing at these values; anything else is refused.
_REFUSED_UNLESS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("previous_response_id", ()),
    ("conversation", ()),
    ("store", (False,)),
    ("background", (False,)),
    ("include", ([],)),
    ("reasoning", ()),
    ("truncation", ("disabled",)),
    ("prompt", ()),
    ("max_tool_calls", ()),
    ("top_logprobs", (0,)),
)
_WHY_REFUSED = {
    "previous_response_id": "no response store is kept; send the whole conversation in input",
    "conversation": "no conversation store is kept; send the whole conversation in input",
    "store": "no response store is kept",
}
# Sampling fields passed to the chat pipeline as they are (vLLM's ResponsesRequest takes
# these too); the chat parser validates them.
_PASSED_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
                  "ignore_eos", "min_tokens", "logit_bias", "parallel_tool_calls",
                  "service_tier", "metadata", "user", "request_id", "speculation",
                  "structured_outputs", "skip_special_tokens", "include_stop_str_in_output")
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _refuse_unhonoured(body: dict[str, Any]) -> None:
    for name, accepted in _REFUSED_UNLESS:
        value = body.get(name)
        if value is None or any(type(value) is type(ok) and value == ok for ok in accepted):
            continue
        why = _WHY_REFUSED.get(name, "specdec cannot honour it")
        raise InvalidRequestError(f"{name} is not supported: {why}.", name)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not (
                    isinstance(part.get("text"), str)):
                raise InvalidRequestError(
                    f"{where} parts must be {{\"type\": \"input_text\", \"text\": string}}; "
                    "only text is supported.", "input")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"{where} must be a string or an array of text parts.", "input")


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; a list holds messages,
    function calls (an assistant's tool_calls) and function call outputs (tool messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input must be a string or a non-empty array of items.",
                                  "input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _MESSAGE_ROLES:
            messages.append({"role": item["role"],
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise InvalidRequestError(
                f"{where} must be a message (role user, assistant, system or developer), a "
                "function_call or a function_call_output; other item types are not "
                "supported.", "input")
    return messages


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat's nested ones; other tool types are refused."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequestError("tools must be an array.", "tools")
    tools = []
    for index, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(
                f"tools[{index}].type must be \"function\"; built-in tools (web search, file "
                "search, MCP, ...) are not supported.", "tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` -> chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("text must be an object.", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError(
            "text.format.type must be \"text\", \"json_object\" or \"json_schema\".",
            "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    json_schema = {key: fmt[key] for key in ("name", "schema", "strict", "description")
                   if fmt.get(key) is not None}
    return {"type": "json_schema", "json_schema": json_schema}


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request asks for; raises InvalidRequestError."""
    _refuse_unhonoured(body)
    messages = _input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequestError("instructions must be a string.", "instructions")
        messages = [{"role": "system", "content": instructions}, *messages]
    chat: dict[str, Any] = {key: body[key] for key in _PASSED_FIELDS if key in body}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": chat_usage.get("prompt_tokens_details")
            or {"cached_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"],
            "speculation": chat_usage.get("speculation")}


class ResponseShell:
    """The Response object's fields that echo the request; `build` adds the outcome."""

    def __init__(self, body: dict[str, Any], model: str, response_id: str | None = None) -> None:
        self.id = response_id or _item_id("resp")
        self.created_at = int(time.time())
        self._fields = {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": model,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "truncation": "disabled",
            "metadata": body.get("metadata") or {},
            "user": body.get("user"),
        }

    def build(self, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": None, "incomplete_details": incomplete,
                "output": output, "usage": usage, **self._fields}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_object(shell: ResponseShell, completion: dict[str, Any]) -> dict[str, Any]:
    """A Response from a chat completion of one choice."""
    choice = completion["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(_message_item(_item_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(_item_id("fc"), call, "completed"))
    return shell.build(_status(choice["finish_reason"]), output, _usage(completion.get("usage")))


class _EventWriter:
    """Numbers the events and tracks the open output item."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self.open_item: dict[str, Any] | None = None  # the message or call being streamed
        self.open_text = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def open_message(self) -> list[dict[str, Any]]:
        item = _message_item(_item_id("msg"), "", "in_progress")
        self.open_item, self.open_text = item, ""
        index = len(self.output)
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item["id"],
                           output_index=index, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": [],
                                 "logprobs": []})]

    def text_delta(self, text: str) -> list[dict[str, Any]]:
        events = [] if self.open_item and self.open_item["type"] == "message" else (
            self.close() + self.open_message())
        self.open_text += text
        assert self.open_item is not None
        events.append(self.event("response.output_text.delta", item_id=self.open_item["id"],
                                 output_index=len(self.output), content_index=0, delta=text,
                                 logprobs=[]))
        return events

    def open_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        item = _call_item(_item_id("fc"), {**call, "function": {**call["function"],
                                                                "arguments": ""}},
                          "in_progress")
        self.open_item, self.open_text = item, ""
        events.append(self.event("response.output_item.added", output_index=len(self.output),
                                 item=item))
        return events + self.arguments_delta(call["function"].get("arguments") or "")

    def arguments_delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        assert self.open_item is not None
        self.open_text += text
        return [self.event("response.function_call_arguments.delta",
                           item_id=self.open_item["id"], output_index=len(self.output),
                           delta=text)]

    def close(self) -> list[dict[str, Any]]:
        """The .done events of the open item, which joins the output."""
        item, text = self.open_item, self.open_text
        if item is None:
            return []
        self.open_item = None
        index = len(self.output)
        if item["type"] == "message":
            done = _message_item(item["id"], text, "completed")
            part = done["content"][0]
            events = [self.event("response.output_text.done", item_id=item["id"],
                                 output_index=index, content_index=0, text=text, logprobs=[]),
                      self.event("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0, part=part)]
        else:
            done = {**item, "arguments": text, "status": "completed"}
            events = [self.event("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=index, arguments=text)]
        self.output.append(done)
        return [*events, self.event("response.output_item.done", output_index=index, item=done)]


async def response_events(shell: ResponseShell,
                          chunks: AsyncIterator[dict[str, Any]]) -> AsyncGenerator[dict[str, Any], None]:
    """Responses streaming events from a chat stream of one choice (with its usage chunk)."""
    writer = _EventWriter(shell)
    yield writer.event("response.created", response=shell.build("in_progress", [], None))
    yield writer.event("response.in_progress", response=shell.build("in_progress", [], None))
    finish_reason = None
    usage = None
    async for chunk in chunks:
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                for event in writer.text_delta(delta["content"]):
                    yield event
            for call in delta.get("tool_calls") or []:
                events = (writer.open_call(call) if call.get("id")
                          else writer.arguments_delta(call["function"].get("arguments") or ""))
                for event in events:
                    yield event
            finish_reason = choice["finish_reason"] or finish_reason
    for event in writer.close():
        yield event
    status = _status(finish_reason)
    kind = "response.incomplete" if status == "incomplete" else "response.completed"
    yield writer.event(kind, response=shell.build(status, writer.output, _usage(usage)))
